"""Every CPU kernel on every ISA path this CPU has, in float32 and bfloat16, against torch's reference.

The paths are the builds of `engine.backends.cpu_kernels` (`engine/backends/csrc/vec.h` picks the vector backend from the
compiler flags): "avx512_bf16" (AVX-512 with the BF16 dot products; AMX inside it where the CPU has it), "avx512"
(AVX-512 with VNNI, bf16 widened to float32), "avx_vnni" (AVX2 with 256-bit VNNI) and "avx2" (AVX2 + FMA + F16C).
A machine runs each build whose level's flags it has (cpu_features.available_levels), so the AVX2 path is checked
on every CI machine; a path the CPU lacks is skipped with the reason. The bounds:

- linear: float32 within 1e-4 of a float64 reference (unit-scale outputs, K <= 1536); bfloat16 within bf16's
  half-ulp (one rounding at the end of a float32 sum);
- attention: float32 1e-5, bfloat16 1e-2 of SDPA over the gathered context (float32 softmax); over float16 caches
  (`--kv-cache-dtype float16`), float32 q gives the bits of the same kernel over the caches widened to float32;
- add + RMSNorm: float32 1e-6 relative, bfloat16 one bf16 ulp;
- argmax: torch.argmax's answers exactly (first maximum, NaN largest);
- decoder: each decode step's logits within 1e-4 (float32) of the op-by-op forward with torch's ops (0.02 over an
  int8 KV cache, where the two read the same int8 values in a different order);

and on every path a row's result is bitwise the same whatever its batch mates are.
"""

from __future__ import annotations

import platform
from typing import Any

import pytest
import torch

from config import tool_cache_dir
from engine.backends import cpu_features, cpu_kernels
from engine.types import SamplingParams
from tests.support import chat_ids, run_all, tokens_of

DTYPES = [torch.float32, torch.bfloat16]


def _path_reason(level: str) -> str | None:
    """Why this machine cannot run `level`'s build, or None."""
    if cpu_kernels.unsupported_reason() is not None and cpu_kernels.build_level() is not None:
        return str(cpu_kernels.unsupported_reason())  # no compiler
    if level == "neon":
        return None if platform.machine() in ("aarch64", "arm64") else "not an aarch64 CPU"
    if level not in cpu_features.available_levels():
        return f"this CPU has no {level} (it has: {', '.join(cpu_features.available_levels())})"
    return None


PATHS = [pytest.param(level, marks=pytest.mark.skipif(_path_reason(level) is not None,
                                                      reason=f"{level} path: {_path_reason(level)}"))
         for level in cpu_kernels.LEVELS]  # fmt: skip


@pytest.fixture(scope="module", params=PATHS)
def path(request: pytest.FixtureRequest) -> tuple[str, Any]:
    module = cpu_kernels.load(tool_cache_dir(), level=request.param)
    assert module is not None, f"the {request.param} build must load where the CPU has it"
    assert module.isa() == request.param
    return request.param, module


def _linear_case(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 960), (3, 64, 7), (8, 1536, 100), (13, 128, 33)])
def test_linear_matches_a_float64_reference(path: tuple[str, Any], dtype: torch.dtype, m: int, k: int,
                                            n: int) -> None:
    _, module = path
    x, w, b = _linear_case(m, k, n, dtype)
    ref = x.double() @ w.double().T + b.double()
    got = module.linear_small(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    if dtype == torch.float32:
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4), (got.double() - ref).abs().max()
    else:
        assert torch.allclose(got.double(), ref, rtol=2**-8, atol=1e-3), (got.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_their_batch_mates(path: tuple[str, Any], dtype: torch.dtype) -> None:
    _, module = path
    x, w, b = _linear_case(11, 576, 200, dtype, seed=3)
    alone = torch.cat([module.linear_small(x[i : i + 1], w, b) for i in range(11)])
    for m in (2, 5, 8, 11):
        assert torch.equal(module.linear_small(x[:m], w, b), alone[:m])
    assert torch.equal(module.linear_small(x.flip(0), w, b), alone.flip(0))


def _paged(dtype: torch.dtype, lengths: list[int], heads: int, kv_heads: int, dim: int, block_size: int = 4,
           softcap: float = 0.0) -> dict:
    """Random caches, each sequence's blocks scattered, and the float32 reference (scores soft-capped by `softcap`:
    x -> softcap * tanh(x / softcap), Gemma 2's)."""
    g = torch.Generator().manual_seed(sum(lengths) + dim)
    need = [-(-n // block_size) for n in lengths]
    ids = torch.randperm(sum(need), generator=g)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.long)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start : start + n]
        start += n
    k = torch.randn(sum(need) * block_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn_like(k, dtype=torch.float32).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=g).to(dtype)
    ref = []
    for i, n in enumerate(lengths):
        pos = torch.arange(n)
        rows = tables[i, pos // block_size] * block_size + pos % block_size
        keys, values = k[rows].float().transpose(0, 1), v[rows].float().transpose(0, 1)  # [kv_heads, n, dim]
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), keys) * dim**-0.5
        scores = torch.tanh(scores / softcap) * softcap if softcap else scores
        ref.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), values))
    return {"args": (q, k, v, tables, torch.tensor(lengths), block_size, dim**-0.5, softcap), "ref": torch.stack(ref)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "kv_heads", "group"), [(32, 2, 3), (64, 1, 5), (128, 2, 2), (96, 1, 2)])
def test_paged_decode_attention_matches_sdpa(path: tuple[str, Any], dtype: torch.dtype, dim: int, kv_heads: int,
                                             group: int) -> None:
    _, module = path
    case = _paged(dtype, [1, 9, 64, 130], kv_heads * group, kv_heads, dim)
    got = module.paged_decode_attention(*case["args"])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), case["ref"], atol=tol, rtol=tol)
    q, k, v, tables, lengths, block_size, scale, cap = case["args"]
    alone = module.paged_decode_attention(q[2:3], k, v, tables[2:3], lengths[2:3], block_size, scale, cap)
    assert torch.equal(alone, got[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "kv_heads", "group"), [(32, 2, 3), (128, 2, 2), (256, 2, 2)])
def test_paged_decode_attention_soft_caps_its_scores(path: tuple[str, Any], dtype: torch.dtype, dim: int,
                                                     kv_heads: int, group: int) -> None:
    """Gemma 2's attention logit soft-capping (here at 0.5, so that it binds on these unit-scale scores; Gemma 2's
    own is 50 on larger ones), on the register-resident head dims and the generic loop (Gemma 2's 256): the capped
    reference, not the uncapped one, batch invariant."""
    _, module = path
    case = _paged(dtype, [1, 9, 64, 130], kv_heads * group, kv_heads, dim, softcap=0.5)
    got = module.paged_decode_attention(*case["args"]).float()
    plain = _paged(dtype, [1, 9, 64, 130], kv_heads * group, kv_heads, dim)["ref"]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got, case["ref"], atol=tol, rtol=tol), (got - case["ref"]).abs().max()
    assert (plain - case["ref"]).abs().max() > 20 * tol  # the cap binds
    q, k, v, tables, lengths, block_size, scale, cap = case["args"]
    alone = module.paged_decode_attention(q[3:4], k, v, tables[3:4], lengths[3:4], block_size, scale, cap)
    assert torch.equal(alone.float(), got[3:4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "kv_heads", "group"), [(64, 1, 5), (96, 1, 2)])
def test_paged_decode_attention_over_float16_caches(path: tuple[str, Any], dtype: torch.dtype, dim: int,
                                                    kv_heads: int, group: int) -> None:
    """`--kv-cache-dtype float16` on this path: float16 caches are widened exactly, so the result is the kernel's
    own over the widened caches (float32 q: bitwise; bfloat16 q: within bf16 rounding)."""
    _, module = path
    q, k, v, tables, lengths, block_size, scale, cap = _paged(dtype, [1, 9, 64, 130], kv_heads * group, kv_heads,
                                                              dim)["args"]
    k16, v16 = k.half(), v.half()
    got = module.paged_decode_attention(q, k16, v16, tables, lengths, block_size, scale, cap)
    widened = module.paged_decode_attention(q.float(), k16.float(), v16.float(), tables, lengths, block_size, scale,
                                            cap)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, widened)
    else:
        assert torch.allclose(got.float(), widened, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_the_torch_ops(path: tuple[str, Any], dtype: torch.dtype) -> None:
    _, module = path
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(5, 580, generator=g) * 3).to(dtype)  # 580: a tail past the last full vector
    delta, weight = torch.randn(5, 580, generator=g).to(dtype), torch.rand(580, generator=g).to(dtype)
    h_ref = h.clone()
    ref = cpu_kernels.add_rms_norm_torch(h_ref, delta.clone(), weight, 1e-5)
    got = module.add_rms_norm_(h, delta, weight, 1e-5)
    assert torch.equal(h, h_ref)  # the residual add rounds like torch's
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(got.float(), ref.float(), rtol=rtol, atol=1e-6)
    assert torch.equal(module.add_rms_norm_(h[3:4].clone(), None, weight, 1e-5),
                       module.add_rms_norm_(h.clone(), None, weight, 1e-5)[3:4])


def test_argmax_rows_gives_torch_argmax_answers(path: tuple[str, Any]) -> None:
    _, module = path
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 17, 49157):
        x = torch.randn(3, n, generator=g)
        assert torch.equal(module.argmax_rows(x), x.argmax(-1)), n
    x = torch.zeros(3, 40)
    x[0, [7, 20]] = 3.0
    x[1, 30], x[1, 33], x[1, 2] = float("nan"), float("nan"), float("inf")
    x[2] = float("-inf")
    assert module.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [7, 30, 0]


def _random_llama(dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=400, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_call_decoder_matches_the_op_by_op_forward(path: tuple[str, Any], dtype: torch.dtype, kv: str,
                                                       byte_level_tokenizer: Any, engine_factory: Any) -> None:
    """Every decode step of a batched greedy run is computed op by op with torch's ops and by this path's decoder
    from the same cache; a row's decoder logits do not change when it decodes alone. Over an int8 KV cache too
    (`--kv-cache-dtype int8`: the op-by-op pass attends over the dequantized blocks)."""
    from tests.support import Loaded, decoder_against_op_by_op

    _, module = path
    engine = engine_factory(Loaded(_random_llama(dtype), byte_level_tokenizer, 512), kv_cache_bytes=8 << 20,
                            block_size=4, cpu_kernels=False, kv_cache_dtype=kv)
    cls = getattr(module, f"LlamaDecoder_{str(dtype).removeprefix('torch.')}{'_kv_int8' if kv == 'int8' else ''}")

    def factory(*args: object) -> object:
        return cls(*args, False)

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    steps = decoder_against_op_by_op(engine, factory, {f"r{i}": (list(range(3 + 5 * i, 10 + 9 * i)), params)
                                                       for i in range(3)})
    assert len(steps) >= 4 and all(step.batch_invariant for step in steps), "a row changed with its batch mates"
    errors = [step.error for step in steps]
    assert max(errors) <= (1e-4 if dtype == torch.float32 and kv == "auto" else 0.02), errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_call_decoder_with_many_rows_gives_a_row_the_bits_it_gets_alone(
        path: tuple[str, Any], dtype: torch.dtype, byte_level_tokenizer: Any, engine_factory: Any) -> None:
    """Up to 8192 residual elements a step (64 rows of this model's 128) every thread normalizes every row itself;
    past that the threads share the rows and meet at a barrier. 66 requests decode past that line while the row
    decoded alone stays below it: both give the row the same bits, and both agree with the op-by-op pass. The
    attention items of rows of different lengths (16 to 80 positions, the last chunk partial) are split between
    threads by positions and merged by whichever thread attends a head's last chunk; the row alone has few items,
    which become one per query head."""
    from tests.support import Loaded, decoder_against_op_by_op

    _, module = path
    engine = engine_factory(Loaded(_random_llama(dtype), byte_level_tokenizer, 512), kv_cache_bytes=32 << 20,
                            block_size=4, cpu_kernels=False, max_num_seqs=66,
                            max_num_batched_tokens=4096)  # every prompt in the first step
    cls = getattr(module, f"LlamaDecoder_{str(dtype).removeprefix('torch.')}")

    def factory(*args: object) -> object:
        return cls(*args, False)

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    requests = {f"r{i}": (list(range(3 + i, 3 + i + 16 + i % 65)), params) for i in range(66)}
    steps = decoder_against_op_by_op(engine, factory, requests)
    assert any(step.got.shape[0] == 66 for step in steps), [step.got.shape[0] for step in steps]
    assert all(step.batch_invariant for step in steps), "a row changed with its batch mates"
    errors = [step.error for step in steps]
    assert max(errors) <= (1e-4 if dtype == torch.float32 else 0.02), errors


def test_the_avx2_path_is_what_a_capped_engine_uses(monkeypatch: pytest.MonkeyPatch, tiny: Any,
                                                    engine_factory: Any) -> None:
    """The cap avx2 (EngineConfig.cpu_isa) on any x86 CPU with AVX2 gives the engine the AVX2 build's kernels."""
    if _path_reason("avx2") is not None:
        pytest.skip(f"avx2 path: {_path_reason('avx2')}")
    engine = engine_factory(tiny, cpu_isa="avx2")
    assert engine.kernels.path == "avx2" and engine.runner.decode_attention is not None


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels.unsupported_reason() is not None, reason=f"{cpu_kernels.unsupported_reason()}")
def test_bundled_model_float32_greedy_is_the_same_with_kernels_on_and_off(smollm2_fp32: Any,
                                                                         engine_factory: Any) -> None:
    tok = smollm2_fp32.tokenizer
    prompts = [chat_ids(tok, q) for q in ("What is the capital of France?", "Name three colors.")]
    answers = {}
    for enabled in (True, False):
        engine = engine_factory(smollm2_fp32, kv_cache_bytes=32 << 20, max_num_batched_tokens=256,
                                cpu_kernels=enabled)
        assert (engine.kernels.path == "torch") is not enabled
        outs = run_all(engine, {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=12))
                                for i, p in enumerate(prompts)})
        answers[enabled] = [tokens_of(outs[f"r{i}"]) for i in range(len(prompts))]
    assert answers[True] == answers[False], [tok.decode(a) for a in answers[True] + answers[False]]
