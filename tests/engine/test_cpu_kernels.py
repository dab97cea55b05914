"""engine.backends.cpu_kernels: the kernels on the best path this CPU has (AVX-512, else AVX2), their dispatch, and their
fallback. tests/engine/test_cpu_kernels_paths.py runs every path the CPU has, in float32 and bfloat16.

The kernel tests compile the real extension (cached under the user's Peregrine cache, like the server does) and
skip, with the reason, on a CPU without AVX2 (or NEON) or a machine without a C++ compiler."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from config import tool_cache_dir
from engine.backends import build as extension_build
from engine.backends import cpu_kernels
from engine.backends import kernels as kernels_module
from engine.backends.kernels import KernelOptions, float32_linear_for, linear_torch
from engine.types import SamplingParams
from tests.support import chat_ids, part_at_near_ties, run_all, tokens_of

CACHE = tool_cache_dir()
ON, OFF = KernelOptions(True, CACHE), KernelOptions(False, CACHE)
REASON = cpu_kernels.unsupported_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")

SHAPES = [(1, 576, 960), (1, 1536, 576), (2, 576, 3072), (3, 64, 7), (4, 576, 49152 // 8), (5, 2048, 40), (8, 64, 33),
          (13, 128, 100)]  # (M, K, N)


@pytest.fixture(scope="module")
def kernel() -> Any:
    module = cpu_kernels.load(CACHE)
    assert module is not None, "unsupported_reason() said the kernel can run, so it must build"
    return module


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, w, b


@needs_kernel
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_kernel_matches_a_float32_reference(kernel: Any, m: int, k: int, n: int) -> None:
    x, w, b = _case(m, k, n)
    ref = x.float() @ w.float().T + b.float()
    got = kernel.linear_small(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 accumulation, one bf16 rounding at the end: within bf16's half-ulp of the exact result
    assert torch.allclose(got.float(), ref, rtol=2**-8, atol=1e-3), (got.float() - ref).abs().max()
    no_bias = kernel.linear_small(x, w, None).float()
    assert torch.allclose(no_bias, x.float() @ w.float().T, rtol=2**-8, atol=1e-3)
    # and as close to torch's own bf16 linear as two bf16 roundings allow
    assert torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=2**-7, atol=2e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [576, 2048])
def test_each_row_is_independent_of_its_batch_mates(kernel: Any, k: int, dtype: torch.dtype) -> None:
    """A sequence's logits must not depend on who else is decoding: bitwise, for every batch size (up to 8 rows
    share a pass over the weights, more take several over chunks of weight rows; on AVX-512 three weight rows a
    block from 8 rows, or from 4 where K >= 2048, one below)."""
    x, w, b = (t.to(dtype) for t in _case(19, k, 1000, seed=3))
    alone = torch.cat([kernel.linear_small(x[i : i + 1], w, b) for i in range(19)])
    for m in range(2, 20):
        assert torch.equal(kernel.linear_small(x[:m], w, b), alone[:m]), m
    assert torch.equal(kernel.linear_small(x.flip(0), w, b), alone.flip(0))


@needs_kernel
def test_kernel_rejects_what_it_cannot_compute(kernel: Any) -> None:
    x, w, _ = _case(1, 48, 8)  # K not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.linear_small(x, w, None)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernel.linear_small(x[:2, :32].float(), w[:, :32], None)


@needs_kernel
def test_linear_for_sends_small_bf16_batches_to_the_kernel_and_the_rest_to_torch(kernel: Any) -> None:
    linear = cpu_kernels.linear_for(torch.bfloat16, ON)
    assert linear is not F.linear
    _, last = cpu_kernels.LINEAR_ROWS[(cpu_kernels.build_level(), torch.bfloat16)]
    x, w, b = _case(last + 1, 576, 96)
    assert torch.equal(linear(x[:2], w, b), kernel.linear_small(x[:2], w, b))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # too many rows: oneDNN
    odd = _case(1, 48, 8)
    assert torch.equal(linear(odd[0], odd[1], None), F.linear(odd[0], odd[1]))  # K % 32 != 0
    assert torch.equal(linear(x[:1], w.T.contiguous().T, b), F.linear(x[:1], w, b))  # strided weight


def test_linear_for_keeps_torch_where_the_kernel_does_not_apply() -> None:
    assert cpu_kernels.linear_for(torch.float16, ON) is linear_torch
    assert cpu_kernels.linear_for(torch.bfloat16, OFF) is linear_torch
    # other devices: their backends hand out torch's kernels (tests/engine/test_backends.py)


@pytest.mark.skipif(float32_linear_for("AuthenticAMD") is None, reason="this torch has no oneDNN float32 linear")
def test_torch_linear_runs_float32_on_onednn_within_float32_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMD CPUs linear_torch sends float32 CPU matmuls to oneDNN (not MKL, which runs AVX2 code there; on other
    CPUs torch's own F.linear: here the oneDNN path is set whatever the CPU); the results are F.linear's within
    float32 rounding, with and without bias, for 2-D and 3-D inputs; other dtypes are F.linear's own, and an empty
    input is passed on."""
    assert float32_linear_for("GenuineIntel") is None and float32_linear_for("") is None
    calls: list[tuple[int, ...]] = []
    onednn = float32_linear_for("AuthenticAMD")
    assert onednn is not None

    def counted(x: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return onednn(x, *rest)

    monkeypatch.setattr(kernels_module, "onednn_linear", lambda: counted)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 576, generator=g), torch.randn(96, generator=g)
    inputs = (torch.randn(130, 576, generator=g), torch.randn(2, 7, 576, generator=g), torch.randn(1, 576, generator=g))
    for x in inputs:
        for bias in (None, b):
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = linear_torch(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert len(calls) == 6
    halves = torch.randn(4, 576, generator=g).bfloat16()
    assert torch.equal(linear_torch(halves, w.bfloat16(), None), F.linear(halves, w.bfloat16()))
    assert linear_torch(torch.empty(0, 576), w, b).shape == (0, 96)
    assert len(calls) == 6


def use_broken_sources(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' sources become one file that fails to compile at once (without torch's headers, which take the
    compiler half a minute to read), built through the same code as the real kernels, by a process that has
    built and logged nothing yet (builds are keyed by content: another test's broken source is the same build)."""
    broken = root / "csrc"
    broken.mkdir()
    (broken / "bindings.cpp").write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", broken)
    monkeypatch.setattr(cpu_kernels, "NAME", "broken_kernels")  # torch's builder versions modules by name
    monkeypatch.setattr(extension_build, "_loaded", {})
    monkeypatch.setattr(extension_build, "_failures", {})
    monkeypatch.setattr(cpu_kernels, "_said", set())


@needs_kernel
def test_a_failed_build_falls_back_to_torch_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    use_broken_sources(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="engine.backends.cpu_kernels"):
        linear = cpu_kernels.linear_for(torch.bfloat16, KernelOptions(True, tmp_path / "cache"))
    assert linear is linear_torch
    assert "CPU kernels off (build failed" in caplog.text


@needs_kernel
def test_a_build_left_locked_by_a_killed_builder_does_not_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """torch's `lock` file, left in the build folder by a builder killed midway, is cleared instead of waited on
    forever (the build here fails at once: the source is broken)."""
    use_broken_sources(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    first = cpu_kernels.linear_for(torch.bfloat16, KernelOptions(True, cache))  # makes the build folder
    (build_dir,) = (cache / "kernels").iterdir()
    (build_dir / "lock").touch()  # what a killed torch builder leaves
    extension_build.forget_failures()  # retry the failed build
    with caplog.at_level(logging.WARNING):
        again = cpu_kernels.linear_for(torch.bfloat16, KernelOptions(True, cache))
    assert first is again is linear_torch
    assert "left by a build that was stopped midway" in caplog.text and not (build_dir / "lock").exists()


@needs_kernel
@pytest.mark.slow
def test_smollm2_bf16_engine_with_and_without_the_kernel_agrees(smollm2: Any, engine_factory: Any) -> None:
    """The same greedy answers from the kernel path and from F.linear, lone and batched, but at near ties: bf16
    rounding in another order can move one (the bundled model's "The" / "L" after "What is the capital of France?"
    are 0.09 apart in float32), so the runs may part only where the F.linear run's top two are within 0.5."""
    tok = smollm2.tokenizer
    prompts = [chat_ids(tok, q) for q in ("What is the capital of France?", "Name a colour of the sky.",
                                           "What is 2 + 2?")]
    answers = {}
    for enabled in (True, False):
        engine = engine_factory(smollm2, kv_cache_bytes=32 << 20, max_num_batched_tokens=256, cpu_kernels=enabled)
        assert (engine.runner._forward.linear is linear_torch) is not enabled
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
        answers[enabled] = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
        assert (engine.runner._forward._decoder is not None) is enabled  # decode steps ran as one kernel call
    parted = [part_at_near_ties(answers[True][r], answers[False][r]) for r in answers[True]]
    assert max(diff for _, diff in parted) <= 0.5, parted
    assert sum(shared >= 4 for shared, _ in parted) >= 2, parted


def _paged_case(dtype: torch.dtype, lengths: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 32,
                block_size: int = 4) -> dict[str, Any]:
    """Random caches with each sequence's blocks scattered (shuffled block ids), plus the SDPA reference."""
    g = torch.Generator().manual_seed(len(lengths))
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    ids = torch.randperm(sum(blocks_per_seq) + 3, generator=g).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(ids[start : start + n])
        start += n
    width = max(blocks_per_seq)
    slots = (len(ids) + 1) * block_size
    k = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=g).to(dtype)
    ref = []
    for i, n in enumerate(lengths):
        table = torch.tensor(tables[i])
        pos = torch.arange(n)
        rows = table[pos // block_size] * block_size + pos % block_size
        keys, values = k[rows].float().transpose(0, 1), v[rows].float().transpose(0, 1)  # [kv_heads, n, dim]
        ref.append(F.scaled_dot_product_attention(q[i].float()[:, None], keys, values, enable_gqa=True)[:, 0])
    padded = torch.tensor([t + [len(ids)] * (width - len(t)) for t in tables])
    return {"q": q, "k": k, "v": v, "tables": padded, "lengths": torch.tensor(lengths), "block_size": block_size,
            "ref": torch.stack(ref)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "kv_heads", "group"), [
    (32, 2, 3),  # head dims 32, 64 and 128 take the register-resident path, in passes of a few heads
    (64, 3, 3), (64, 1, 5), (64, 1, 8), (128, 1, 4), (128, 2, 1),
    (96, 2, 2),  # any other head dim: the generic loop
])  # fmt: skip
def test_paged_decode_attention_matches_sdpa_over_the_gathered_context(
    kernel: Any, dtype: torch.dtype, dim: int, kv_heads: int, group: int
) -> None:
    case = _paged_case(dtype, [1, 5, 17, 64, 130], heads=kv_heads * group, kv_heads=kv_heads, dim=dim)
    got = kernel.paged_decode_attention(case["q"], case["k"], case["v"], case["tables"], case["lengths"],
                                        case["block_size"], case["q"].shape[-1] ** -0.5, 0.0)
    assert got.dtype == dtype and got.shape == case["q"].shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), case["ref"], atol=tol, rtol=tol), (got.float() - case["ref"]).abs().max()
    # a row's result does not depend on the other rows of the batch
    alone = kernel.paged_decode_attention(case["q"][2:3], case["k"], case["v"], case["tables"][2:3],
                                          case["lengths"][2:3], case["block_size"], case["q"].shape[-1] ** -0.5, 0.0)
    assert torch.equal(alone, got[2:3])


@needs_kernel
@pytest.mark.parametrize(("dim", "kv_heads", "group"), [(64, 3, 3), (128, 2, 1), (96, 2, 2)])
def test_paged_decode_attention_over_a_float16_cache(kernel: Any, dim: int, kv_heads: int, group: int) -> None:
    """`--kv-cache-dtype float16`: the kernel reads float16 caches exactly, so a float32 q gives the bits the
    float32 kernel gives over the same values widened; a bfloat16 q matches SDPA within bf16 rounding."""
    case = _paged_case(torch.float32, [1, 5, 17, 64, 130], heads=kv_heads * group, kv_heads=kv_heads, dim=dim)
    k16, v16 = case["k"].half(), case["v"].half()
    args = (case["tables"], case["lengths"], case["block_size"], dim**-0.5, 0.0)
    got = kernel.paged_decode_attention(case["q"], k16, v16, *args)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernel.paged_decode_attention(case["q"], k16.float(), v16.float(), *args))
    assert (got - case["ref"]).abs().max() < 0.02  # the float16 rounding of k and v, against the float32 reference
    q16 = case["q"].to(torch.bfloat16)
    got_bf16 = kernel.paged_decode_attention(q16, k16, v16, *args)
    widened = kernel.paged_decode_attention(q16.float(), k16.float(), v16.float(), *args)
    assert got_bf16.dtype == torch.bfloat16 and torch.allclose(got_bf16.float(), widened, atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="float16"):  # a cache in neither q's dtype nor float16
        kernel.paged_decode_attention(case["q"], k16.to(torch.bfloat16), v16.to(torch.bfloat16), *args)


@needs_kernel
def test_engines_on_cpu_use_the_decode_attention_kernel_unless_turned_off(tiny: Any, engine_factory: Any) -> None:
    assert engine_factory(tiny).runner.decode_attention is not None
    assert engine_factory(tiny, cpu_kernels=False).runner.decode_attention is None
    # greedy sampling's argmax too
    assert engine_factory(tiny).sampler._argmax is not cpu_kernels.argmax_torch
    assert engine_factory(tiny, cpu_kernels=False).sampler._argmax is cpu_kernels.argmax_torch


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_add_rms_norm_matches_the_torch_ops(kernel: Any, dtype: torch.dtype, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(7, 576, generator=g).to(dtype) if with_delta else None
    weight = torch.rand(576, generator=g).to(dtype)
    h_ref = h.clone()
    ref = cpu_kernels.add_rms_norm_torch(h_ref, None if delta is None else delta.clone(), weight, 1e-5)
    got = kernel.add_rms_norm_(h, delta, weight, 1e-5)
    assert torch.equal(h, h_ref)  # the residual add, in place, rounds like torch's
    # same rounding steps; only the order of the float32 sum of squares differs
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(got.float(), ref.float(), rtol=ulp, atol=1e-6), (got.float() - ref.float()).abs().max()
    if dtype == torch.bfloat16:  # rounded to bf16 twice: nearly every element lands on the same value
        assert (got == ref).float().mean() > 0.95


def test_add_rms_norm_for_keeps_torch_for_other_dtypes_and_when_off() -> None:
    assert cpu_kernels.add_rms_norm_for(torch.float16, ON) is cpu_kernels.add_rms_norm_torch
    assert cpu_kernels.add_rms_norm_for(torch.bfloat16, OFF) is cpu_kernels.add_rms_norm_torch


# --- LlamaDecoder: the whole decode step in one call -------------------------------------------------------

_MODULE = cpu_kernels.load(CACHE) if REASON is None else None
AMX = bool(_MODULE is not None and _MODULE.amx_available())


def _decoder_model(model_type: str, vocab: int) -> Any:
    """A 2-layer random bf16 model with shapes the decoder takes (head_dim 32, GQA 4:2); Qwen2 adds q/k/v biases."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(7)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False))
        for layer in model.model.layers:  # random biases, so a wrong bias path shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, initializer_range=0.1))
    return model.to(torch.bfloat16).eval()


@needs_kernel
@pytest.mark.parametrize("amx", [pytest.param(True, marks=pytest.mark.skipif(not AMX, reason="no AMX here")), False])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_one_call_decode_step_matches_the_op_by_op_forward(byte_level_tokenizer: Any, engine_factory: Any,
                                                           amx: bool, model_type: str) -> None:
    """Every decode step of a batched greedy run is computed twice, op by op and by the decoder, from the same
    cache: the logits agree within bf16 rounding (different summation orders), and the decoder's rows do not
    depend on their batch mates."""
    from tests.support import Loaded, decoder_against_op_by_op

    vocab = -(-len(byte_level_tokenizer) // 16) * 16
    loaded = Loaded(_decoder_model(model_type, vocab), byte_level_tokenizer, 512)
    engine = engine_factory(loaded, kv_cache_bytes=8 << 20, block_size=4)
    factory = cpu_kernels.llama_decoder_for(torch.bfloat16, ON, amx=amx)
    prompts = {f"r{i}": (list(range(3 + 5 * i, 10 + 9 * i)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
               for i in range(3)}
    steps = decoder_against_op_by_op(engine, factory, prompts)
    assert sum(step.got.shape[0] == 3 for step in steps) >= 4
    for step in steps:
        assert step.error <= 0.02, step.error
        assert step.batch_invariant, "a row's logits changed with its batch mates"


@needs_kernel
@pytest.mark.parametrize("kv", ["float16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_decode_step_over_a_narrow_kv_cache(byte_level_tokenizer: Any, engine_factory: Any,
                                                     dtype: torch.dtype, kv: str) -> None:
    """`--kv-cache-dtype float16` / `int8`: the decoder writes this step's keys and values into the narrow caches and
    attends over them as the op-by-op pass does (float16: its `k.to(cache.dtype)`, then the decode attention kernel;
    int8: kv_cache.quantize_kv's operations (attention.h's quantize_kv_row), each position's score taken times its
    K scale and its softmax weight times its V scale, where the op-by-op pass attends over the dequantized blocks).
    For int8, given the same keys both store the same values: the first layer's, written by the decoder, against
    quantize_kv of the op-by-op pass's float keys (one step apart at most, where summation order moved a key)."""
    from engine.model.kv_cache import quantize_kv
    from tests.support import Loaded, decoder_against_op_by_op

    vocab = -(-len(byte_level_tokenizer) // 16) * 16
    loaded = Loaded(_decoder_model("llama", vocab).to(dtype), byte_level_tokenizer, 512)
    engine = engine_factory(loaded, kv_cache_bytes=4 << 20, block_size=4, kv_cache_dtype=kv)
    assert engine.kv_cache.k[0].dtype == getattr(torch, kv) and bool(engine.kv_cache.k_scale) == (kv == "int8")
    factory = cpu_kernels.llama_decoder_for(dtype, ON, amx=False)
    prompts = {f"r{i}": (list(range(3 + 5 * i, 10 + 9 * i)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
               for i in range(3)}
    fast = engine.runner._forward
    steps = decoder_against_op_by_op(engine, factory, prompts)
    assert type(fast._decoder[1]).__name__ == f"LlamaDecoder_{str(dtype).removeprefix('torch.')}_kv_{kv}"
    assert sum(step.got.shape[0] == 3 for step in steps) >= 4
    for step in steps:
        assert step.error <= (1e-4 if dtype == torch.float32 and kv == "float16" else 0.02), step.error
        assert step.batch_invariant, "a row's logits changed with its batch mates"
    if kv != "int8":
        return
    fresh = engine_factory(loaded, kv_cache_bytes=4 << 20, block_size=4, kv_cache_dtype="int8")
    reference = engine_factory(loaded, kv_cache_bytes=4 << 20, block_size=4, kv_cache_dtype="float32",
                               cpu_kernels=False)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run_all(fresh, {"a": ([5, 6, 7, 8, 9], params)})
    run_all(reference, {"a": ([5, 6, 7, 8, 9], params)})
    written = fresh.kv_cache.k_scale[0].gt(0).all(-1).nonzero().flatten()  # the decoder's: prompt, first decode
    assert written.tolist() == reference.kv_cache.k[0].ne(0).any(-1).any(-1).nonzero().flatten().tolist()
    assert len(written) == 6
    q, s = quantize_kv(reference.kv_cache.k[0][written].to(dtype))  # the first layer: the same input in both runs
    assert (fresh.kv_cache.k[0][written].int() - q.int()).abs().max() <= 1  # summation order moves a rounding at most
    assert torch.allclose(fresh.kv_cache.k_scale[0][written], s, rtol=1e-2)


@needs_kernel
def test_the_decoder_declines_shapes_it_cannot_take_and_the_op_by_op_pass_runs(
        tiny: Any, byte_level_tokenizer: Any, engine_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The tiny test Llama has head_dim 16 and a vocabulary that is not a multiple of 16: the decoder says why it
    is off, once, and the engine still generates."""
    import copy

    from tests.support import Loaded

    loaded = Loaded(copy.deepcopy(tiny.model).to(torch.bfloat16), tiny.tokenizer, tiny.max_model_len)
    engine = engine_factory(loaded)
    with caplog.at_level(logging.INFO, logger="engine.model.forward"):
        outs = run_all(engine, {"a": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))})
    assert len(tokens_of(outs["a"])) == 4
    assert caplog.text.count("one-call decode step off") == 1
    assert engine.runner._forward._decoder is None


def test_no_decoder_for_float16_other_devices_or_when_off() -> None:
    assert cpu_kernels.llama_decoder_for(torch.float16, ON) is None
    assert cpu_kernels.llama_decoder_for(torch.bfloat16, OFF) is None


def test_decoder_rope_rows_are_the_rotary_modules_values(tiny: Any) -> None:
    """The decoder's RoPE table gives each position exactly what the model's rotary module computes for it, and
    grows when a later position needs it; a dynamic RoPE type is computed per step instead."""
    from engine.model.forward import LlamaFastForward

    model = tiny.model
    fast = LlamaFastForward(model)
    rotary = model.model.rotary_emb
    probe = torch.empty(0, dtype=model.model.embed_tokens.weight.dtype)
    for positions in (torch.tensor([0, 5, 17]), torch.tensor([3, 700])):
        rows, cos, sin = fast.decoder_rope(positions)
        want_cos, want_sin = rotary(probe, positions[None])
        assert torch.equal(cos[rows], want_cos[0]) and torch.equal(sin[rows], want_sin[0])
    assert fast._rope_table is not None and fast._rope_table[0].shape[0] == 1024  # doubled past position 700
    fast._static_rope = False
    rows, cos, sin = fast.decoder_rope(torch.tensor([9, 2]))
    assert rows.tolist() == [0, 1] and torch.equal(cos, rotary(probe, torch.tensor([[9, 2]]))[0][0])


def _bare_decoder() -> tuple[Any, Any]:
    """A bfloat16 LlamaDecoder built by hand over a tiny random Llama (vocab 256), dense weights, a 64-slot cache of
    blocks of 16; with the lean forward that gives its RoPE rows."""
    from engine.model.forward import LlamaFastForward

    model = _decoder_model("llama", 256)
    k = torch.zeros(64, 2, 32, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    fast = LlamaFastForward(model)
    none = torch.empty(0)
    layers = [[w.input_norm, w.post_norm, k, v] for w in fast.layers]
    weights = [[m] for w in fast.layers for m in (w.qkv, w.o, w.gate_up, w.down)] + [[model.lm_head.weight]]
    decoder = _MODULE.LlamaDecoder_bfloat16(model.model.embed_tokens.weight, 0, layers, weights,
                                            [[0]] * len(weights), [none] * len(weights), model.model.norm.weight,
                                            4, 2, 32, 1e-5, 16, 32**-0.5, False)
    return fast, decoder


@needs_kernel
def test_decoder_step_refuses_token_ids_out_of_range() -> None:
    """A token id past the embedding table is a clear error, not a read past the table."""
    fast, decoder = _bare_decoder()
    rows, cos, sin = fast.decoder_rope(torch.tensor([0]))
    ok = decoder.step(torch.tensor([5]), rows, cos, sin, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), None)
    assert ok.dtype == torch.float32 and ok.shape == (1, 256) and torch.isfinite(ok).all()
    with pytest.raises(RuntimeError, match="out of range"):
        decoder.step(torch.tensor([256]), rows, cos, sin, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), None)


@needs_kernel
def test_decoder_step_head_rows_are_the_full_steps_rows() -> None:
    """`head_rows` runs the LM head on the named rows only (a prefill chunk's last row): their logits are bitwise
    the full step's rows, in the order named; a row past the step is a clear error."""
    fast, decoder = _bare_decoder()
    ids, positions = torch.tensor([5, 9, 77, 3, 200]), torch.arange(5)
    rows, cos, sin = fast.decoder_rope(positions)
    tables, lengths = torch.zeros(5, 1, dtype=torch.long), positions + 1  # one prompt, its block 0
    full = decoder.step(ids, rows, cos, sin, positions, tables, lengths, None)
    picked = decoder.step(ids, rows, cos, sin, positions, tables, lengths, torch.tensor([4, 1]))
    assert full.shape == (5, 256) and picked.shape == (2, 256)
    assert torch.equal(picked, full[[4, 1]])
    with pytest.raises(RuntimeError, match="head row out of range"):
        decoder.step(ids, rows, cos, sin, positions, tables, lengths, torch.tensor([5]))


@needs_kernel
def test_argmax_rows_gives_torch_argmax_answers(kernel: Any) -> None:
    """Random rows of every length around the 16-wide vectors, ties (the first wins), NaN (counts as the largest,
    the first one wins), all -inf, and a 49k vocabulary."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 33, 49152, 49157):
        x = torch.randn(5, n, generator=g)
        assert torch.equal(kernel.argmax_rows(x), x.argmax(-1)), n
    x = torch.zeros(4, 40)
    x[0, [7, 20, 39]] = 3.0  # a tie: the first
    x[1, 30], x[1, 33], x[1, 2] = float("nan"), float("nan"), float("inf")  # NaN beats inf; the first NaN
    x[2] = float("-inf")
    x[3, 39] = float("nan")  # in the scalar tail
    assert kernel.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [7, 30, 0, 39]
    with pytest.raises(RuntimeError, match="float32"):
        kernel.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))


def test_argmax_for_uses_the_kernel_where_it_applies() -> None:
    assert cpu_kernels.argmax_for(OFF) is cpu_kernels.argmax_torch
    argmax = cpu_kernels.argmax_for(ON)
    assert (argmax is cpu_kernels.argmax_torch) == (REASON is not None)
    x = torch.randn(3, 50)
    for t in (x, x.t().contiguous().t(), x.bfloat16(), x[0]):  # contiguous float32; strided; bf16; 1-D
        assert torch.equal(argmax(t), t.argmax(dim=-1))
