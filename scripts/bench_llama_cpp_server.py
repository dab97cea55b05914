"""Run llama-cpp-python's OpenAI server (`python -m llama_cpp.server ARGS`) with llama.cpp's extra buffer
types off, the equivalent of llama-server's `--no-repack`.

On this machine `-DGGML_NATIVE=ON` compiles ggml's AMX kernels (the CPU reports AMX-INT8), and the first
`llama_decode` then dies with SIGSEGV in `ggml_backend_amx_mul_mat`. The AMX path is chosen through the
"extra buffer types", which llama-cpp-python's `Llama` does not let its caller turn off, so this launcher
turns them off in the model's default parameters before the server builds its model. Used by
`bench_peers.py` for the `llamacpp-python` peer; run it with the peers venv's Python.
"""

from __future__ import annotations

import runpy

import llama_cpp.llama_cpp as llama_lib

_default_params = llama_lib.llama_model_default_params


def _params_without_extra_buffer_types():  # noqa: ANN202 - returns llama_cpp's ctypes struct
    params = _default_params()
    params.use_extra_bufts = False
    return params


if __name__ == "__main__":
    llama_lib.llama_model_default_params = _params_without_extra_buffer_types
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
