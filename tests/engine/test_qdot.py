"""The int8 matmuls on GGUF weights kept quantized (`engine/backends/csrc/qdot.h`: `qlinear`, and the one-call decoder over
quantized weights), on every ISA path this CPU has (the AVX2 body also runs inside the AVX-512 build; a path the
CPU lacks is skipped with the reason). Weights are real GGUF blocks (tests/quant_blocks.py).

Stated bounds:
- against the exact product of the dequantized weights and the activations as quantized to int8 (blocks of 32,
  d = max|x| / 127, as llama.cpp's Q8_0/Q8_1; blocks of 256 for the K-quants, as its Q8_K): 1e-5 of the output
  range (only float32 summation order differs);
- against float activations (what activation quantization costs): 2e-2 of the output range (measured 3e-3 to
  8e-3 on these shapes);
- a row's result is bitwise the same whatever its batch mates are (1 row or 16; 29 for the K-quants' tiles);
- the decoder over quantized weights against the op-by-op pass over the same weights (float32 activations):
  each decode step's logits within 5e-2 of their range (int8 activations in every matmul of 2 layers, measured
  ~1e-2), and greedy tokens the same on at least 2 of 3 sequences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from config import tool_cache_dir
from engine.backends import cpu_kernels
from engine.model.quant import QuantWeight
from engine.types import SamplingParams
from models import gguf_weights
from tests.engine.test_cpu_kernels_paths import PATHS, _path_reason
from tests.quant_blocks import FORMATS, KQUANTS, dequantize, make_blocks, write_tiny_gguf
from tests.support import Loaded, decoder_against_op_by_op

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23}


@pytest.fixture(scope="module", params=PATHS)
def module(request: pytest.FixtureRequest) -> Any:
    built = cpu_kernels.load(tool_cache_dir(), level=request.param)
    assert built is not None and built.isa() == request.param
    return built


def int8_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernels see it: blocks of 32 (256 for the K-quants) rounded to int8 steps of d = max|x| / 127
    (q = round(x * (127 / max|x|)), ties to even, the kernels' own float operations)."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # not 127 / amax: 127 * (1 / amax)
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_qlinear_matches_the_dequantized_product(module: Any, fmt: str) -> None:
    rng = np.random.default_rng(3)
    k = 512 if fmt in KQUANTS else 576
    blocks = make_blocks(fmt, 45, k, rng)  # (45: weight rows past fours of them)
    w = torch.from_numpy(dequantize(blocks, fmt)).double()
    g = torch.Generator().manual_seed(1)
    x, bias = torch.randn(16, k, generator=g), torch.randn(45, generator=g)
    x[3] = 0.0  # an all-zero row: scale 0, no division by zero
    got = module.qlinear(x, torch.from_numpy(blocks), TYPES[fmt], bias)
    assert got.dtype == torch.float32 and got.shape == (16, 45)
    block = 256 if fmt in KQUANTS else 32
    exact = int8_activations(x, block).double() @ w.T + bias.double()
    span = float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= 1e-5 * span
    floats = x.double() @ w.T + bias.double()
    assert float((got.double() - floats).abs().max()) <= 2e-2 * span
    for row in (0, 3, 15):  # alone (and in threes), a row gives the same bits as in the batch of 16
        assert torch.equal(module.qlinear(x[row : row + 1], torch.from_numpy(blocks), TYPES[fmt], bias)[0], got[row])
    shifted = module.qlinear(x, torch.from_numpy(blocks[5:].copy()), TYPES[fmt], bias[5:])  # rows in other lanes
    assert torch.equal(shifted, got[:, 5:]), "a weight row's result changed with its place in the matrix"
    assert torch.equal(module.qlinear(x[4:7], torch.from_numpy(blocks), TYPES[fmt], bias), got[4:7])
    halves = module.qlinear(x.bfloat16(), torch.from_numpy(blocks), TYPES[fmt], None)  # bfloat16 activations
    want = int8_activations(x.bfloat16(), block).double() @ w.T
    assert float((halves.double() - want).abs().max()) <= 1e-5 * span


LANES = ("avx512", "avx512_bf16")  # the builds whose packed Q4_0 / Q4_1 / Q8_0 rows go through qdot_lanes.h
IQ4_LANES = ("avx_vnni", *LANES)  # and whose IQ4_XS rows go through lanes (qdot_lanes_iq4.h, qdot_lanes8.h)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_qlinear_k_quant_tiles_keep_rows_bitwise(module: Any, fmt: str) -> None:
    """Many activation rows against K-quant weights go in tiles (qdot_kquant.h: 8 activation rows at K = 4096, a
    block of weight rows at a time): a prefill-sized batch of 29 rows (tiles of 8, the last of 5) over 150 weight rows
    (more than one block of them) is within the exact int8 product's bound, and each row gives the same bits alone,
    in a batch of 3 that straddles a tile, and in the whole batch; and with the matrix taken from its 6th row on (in
    Q4_K's lanes, qdot_lanes_k.h's 16 and qdot_lanes8.h's 8, every row in another lane and the last tile a whole
    one; qdot_lanes8.h's blocks of 16 activation rows and 56 weight rows at K = 4096 crossed as well). Q6_K takes its
    row loop for one to three activation rows and its lanes (qdot_lanes8.h, qdot_lanes_q6.h) from four: the single
    row and the three against the batch of 29 hold the two to the same bits. IQ4_XS takes its lanes for every number
    of rows in the VNNI builds (qdot_lanes_iq4.h; qdot_lanes8.h in the avx_vnni build)."""
    blocks, x, got = k_quant_product(module, fmt, 150, 4096, 29, seeds=(5, 4))
    for rows in (slice(0, 1), slice(7, 10), slice(28, 29), slice(3, 29)):
        assert torch.equal(module.qlinear(x[rows], blocks, TYPES[fmt], None), got[rows]), rows
    shifted = module.qlinear(x[:5], blocks[5:].clone(), TYPES[fmt], None)  # rows in other lanes
    assert torch.equal(shifted, got[:5, 5:])


def k_quant_product(module: Any, fmt: str, n: int, k: int, rows: int,
                    seeds: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random `fmt` blocks of n weight rows of k and `rows` activation rows (seeds: the blocks', the activations'),
    and their product through `qlinear`, checked within the exact int8 product's bound."""
    blocks = make_blocks(fmt, n, k, np.random.default_rng(seeds[0]))
    w = torch.from_numpy(dequantize(blocks, fmt)).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seeds[1]))
    got = module.qlinear(x, torch.from_numpy(blocks), TYPES[fmt], None)
    exact = int8_activations(x, 256).double() @ w.T
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    return torch.from_numpy(blocks), x, got


@pytest.mark.parametrize("fmt", KQUANTS)
def test_k_quant_long_rows_at_one_activation_row(module: Any, fmt: str) -> None:
    """Rows of 4 KiB or more (K = 8192: an `ffn_down`'s) at one activation row are prefetched a super-block at a time
    inside the row loop (qdot_kquant.h, kSpreadRowBytes): the same sums, so each row alone gives the bits it has in a
    batch of three (no such prefetch) and stays within the exact int8 product's bound, the last rows of the matrix
    (nothing ahead to ask for) included."""
    blocks, x, batch = k_quant_product(module, fmt, 37, 8192, 3, seeds=(8, 9))
    for row in range(3):
        assert torch.equal(module.qlinear(x[row : row + 1], blocks, TYPES[fmt], None)[0], batch[row])


@pytest.mark.parametrize("fmt", KQUANTS)
def test_k_quant_sums_are_the_avx2_bodys_bits_on_every_path(module: Any, fmt: str) -> None:
    """The AVX-512 builds multiply two 32-value groups a 512-bit register (qdot_kquant.h, PEREGRINE_KQ512): the
    same integer sums as the AVX2 body, so the same bits, for one to five activation rows and batches of 11 and 16
    (eight rows a weight row at a time there, kRowsK, then four, two, one), with `vpdpwssd` where the build has VNNI.
    Q4_K goes through lanes in both (qdot_lanes_k.h's 16 rows with `vpdpbusd` there, qdot_lanes8.h's 8 with
    `vpmaddubsw` in the AVX2 build), and so does Q6_K from four rows (qdot_lanes_q6.h's 16, qdot_lanes8.h's 8): the
    same integer sums and float operations, so the same bits too; the avx_vnni build's lanes sum with `vpdpbusd`,
    the same integers again. IQ4_XS goes through lanes of their own in the VNNI builds (qdot_lanes_iq4.h's 16 rows
    with AVX-512 VNNI, qdot_lanes8.h's 8 with AVX-VNNI, every number of rows), and so does Q5_K in the AVX-512 VNNI
    builds (qdot_lanes_k.h's, with its fifth bits): their own float order, the same bits in each of those builds (held
    to the avx512 build's), the row loop's in the others (held to avx2's)."""
    lanes = (fmt == "IQ4_XS" and module.isa() in IQ4_LANES) or (fmt == "Q5_K" and module.isa() in LANES)
    reference = "avx512" if lanes else "avx2"
    if module.isa() in ("none", reference):
        pytest.skip(f"the portable build sums in its own order; {reference} is the reference itself")
    if (reason := _path_reason(reference)) is not None:
        pytest.skip(f"the {reference} reference: {reason}")
    ref = cpu_kernels.load(tool_cache_dir(), level=reference)
    assert ref is not None
    blocks = torch.from_numpy(make_blocks(fmt, 37, 1024, np.random.default_rng(11)))
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(6))
    for rows in (1, 2, 3, 5, 11, 16):
        want = ref.qlinear(x[:rows], blocks, TYPES[fmt], None)
        assert torch.equal(module.qlinear(x[:rows], blocks, TYPES[fmt], None), want), rows




def test_q6_k_lanes_at_the_extremes_of_their_integers(module: Any) -> None:
    """Q6_K's lanes (qdot_lanes8.h, qdot_lanes_q6.h) add four `vpmaddubsw` products in int16 (AVX2) and sum each
    16-value group from -32 times its activations' sum (AVX-512): with every 6-bit value 63 or 0, scales +-127 / -128
    and activations at +-127 after quantization, the sums the format can reach, the result is the exact int8 product
    (within 1e-5 of its range, float32 sums), on every path and for a row alone or among 16."""
    rows, k = 40, 1024
    blocks = np.zeros((rows, k // 256 * 210), np.uint8).reshape(rows, k // 256, 210)
    rng = np.random.default_rng(9)
    blocks[..., :192] = np.where(rng.random((rows, k // 256, 192)) < 0.8, 0xFF, 0x00)  # q = 63 mostly, else 0
    blocks[..., 192:208] = rng.choice(np.array([127, 0x80, 0x81], np.uint8), (rows, k // 256, 16))  # 127, -128, -127
    blocks[..., 208:210] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    blocks = blocks.reshape(rows, -1)
    w = torch.from_numpy(dequantize(blocks, "Q6_K")).double()
    x = torch.where(torch.rand(16, k, generator=torch.Generator().manual_seed(8)) < 0.5, 1.0, -1.0)
    x[:8] = x[:8].abs()  # rows of all +127: every group's sum at its largest
    got = module.qlinear(x, torch.from_numpy(blocks), TYPES["Q6_K"], None)
    exact = int8_activations(x, 256).double() @ w.T
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    assert torch.equal(module.qlinear(x[:1], torch.from_numpy(blocks), TYPES["Q6_K"], None), got[:1])


def test_iq4_xs_lanes_at_the_extremes_of_their_integers(module: Any) -> None:
    """IQ4_XS's lanes (qdot_lanes_iq4.h, qdot_lanes8.h) take the table's values plus 128 (1-241) unsigned in
    `vpdpbusd` and start each 32-value group at -128 times its activations' sum: with every nibble 0 or 15 (the
    table's -127 and 113), scales at -32 / 31 and activations at +-127 after quantization, the result is the exact
    int8 product (within 1e-5 of its range), and a row alone gives the bits it has among 16."""
    rows, k = 40, 1024
    rng = np.random.default_rng(10)
    blocks = rng.choice(np.array([0x00, 0xFF, 0x0F, 0xF0], np.uint8), (rows, k // 256, 136))  # nibbles 0 / 15
    blocks[..., :2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)  # d; scales_h, scales_l: bits 0 or 1
    blocks = blocks.reshape(rows, -1)
    w = torch.from_numpy(dequantize(blocks, "IQ4_XS")).double()
    assert float(w.abs().max()) == pytest.approx(float(np.float16(0.001)) * 32 * 127)  # -32 x -127 reached
    x = torch.where(torch.rand(16, k, generator=torch.Generator().manual_seed(8)) < 0.5, 1.0, -1.0)
    x[:8] = x[:8].abs()  # rows of all +127: every group's sum at its largest
    got = module.qlinear(x, torch.from_numpy(blocks), TYPES["IQ4_XS"], None)
    exact = int8_activations(x, 256).double() @ w.T
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    for row in (0, 9, 15):
        assert torch.equal(module.qlinear(x[row : row + 1], torch.from_numpy(blocks), TYPES["IQ4_XS"], None)[0],
                           got[row])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [576, 1536])  # 18 groups (a last pair past the fours of groups), 48 (none)
def test_qlinear_on_row_packed_weights(module: Any, fmt: str, k: int) -> None:
    """Q4_0 / Q4_1 rows packed for the kernels (as the loader keeps them), 43 of them (two tiles of 16 and a part):
    where the build runs dot_packed, the same bits as the file's blocks for every number of rows (the same sums in the
    same order: only the loads differ), on the few-rows path (1-3 activation rows: four weight rows at a time, scales
    in registers) and the general one. In the AVX-512 builds (qdot_lanes.h: 16 weight rows at a time, one a lane, a
    float order of their own) within 1e-5 of the exact product of the dequantized weights and the int8 activations,
    and a row's bits the same whatever the number of activation rows (1 to 16), its tile and its lane (the matrix
    taken from its 5th row on moves every row to another lane, and the last tile's rows from a part tile to a
    whole one)."""
    blocks = torch.from_numpy(make_blocks(fmt, 43, k, np.random.default_rng(7)))  # (43: rows past fours of rows)
    packed = QuantWeight(blocks, TYPES[fmt], (43, k)).repack()
    assert packed.qtype == TYPES[fmt] + 1000
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    if module.isa() not in LANES:
        for rows in (1, 2, 3, 5, 16):
            want = module.qlinear(x[:rows], blocks, TYPES[fmt], None)
            assert torch.equal(module.qlinear(x[:rows], packed.blocks, packed.qtype, None), want), rows
        return
    got = module.qlinear(x, packed.blocks, packed.qtype, None)
    exact = int8_activations(x).double() @ torch.from_numpy(dequantize(blocks.numpy(), fmt)).double().T
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    for rows in (slice(0, 1), slice(0, 2), slice(3, 6), slice(5, 12), slice(2, 16), slice(15, 16)):
        assert torch.equal(module.qlinear(x[rows], packed.blocks, packed.qtype, None), got[rows]), rows
    shifted = module.qlinear(x, packed.blocks[5:].contiguous(), packed.qtype, None)
    assert torch.equal(shifted, got[:, 5:])


@pytest.mark.parametrize("k", [576, 1536])
def test_qlinear_on_packed_q8_0_matches_the_dequantized_product(module: Any, k: int) -> None:
    """Q8_0 rows packed at load (values, then scales): the AVX-512 builds multiply them unsigned (q + 128, then 128
    times the activation group's sum taken off), 16 weight rows a lane each (qdot_lanes.h), so their sums are not
    bitwise the file layout's, but within the same 1e-5 of the exact int8 product; a row gives the same bits alone,
    in threes and in the batch of 16, on the few-rows path and the general one, and (lanes) in any lane and tile.
    The AVX2 build multiplies them signed, as it does the file's blocks."""
    blocks = make_blocks("Q8_0", 43, k, np.random.default_rng(7))
    packed = QuantWeight(torch.from_numpy(blocks), TYPES["Q8_0"], (43, k)).repack()
    assert packed.qtype == 1008 and torch.equal(packed.unpack().blocks, torch.from_numpy(blocks))
    w = torch.from_numpy(dequantize(blocks, "Q8_0")).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    got = module.qlinear(x, packed.blocks, packed.qtype, None)
    exact = int8_activations(x).double() @ w.T
    assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    for rows in (slice(0, 1), slice(5, 6), slice(4, 7), slice(0, 5), slice(2, 16), slice(15, 16)):
        assert torch.equal(module.qlinear(x[rows], packed.blocks, packed.qtype, None), got[rows]), rows
    shifted = module.qlinear(x, packed.blocks[5:].contiguous(), packed.qtype, None)  # every row in another lane
    assert torch.equal(shifted, got[:, 5:])
    if module.isa() in ("avx2", "avx_vnni"):  # packed Q8_0 multiplied signed, as the file's (kUnsignedQ8)
        assert torch.equal(got, module.qlinear(x, torch.from_numpy(blocks), TYPES["Q8_0"], None))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [576, 1536])
def test_amx_int8_tiles_give_the_lanes_bits(module: Any, fmt: str, k: int) -> None:
    """The tiled Q4_0 / Q4_1 / Q8_0 forms on AMX int8 tiles (`qlinear_amx`: from 9 activation rows, in passes of 16,
    the rows after the last pass on the 16-lane loop when fewer than 9: 17 = 16 + 1, 24 = 16 + 8, 25 = 16 + 9) give
    the 16-lane loop's bits for every number of rows, so a row's logits do not depend on whether its step had
    8 rows or 7: each group's integer sums are exact either way and go through the same float operations. Where the
    build or the CPU has no AMX-INT8, `qlinear_amx` refuses."""
    if not module.amx_int8_available():
        with pytest.raises(RuntimeError, match="AMX"):
            module.qlinear_amx(torch.zeros(8, k), torch.zeros(16, k // 32 * 18, dtype=torch.uint8), TYPES["Q4_0"], None)
        pytest.skip(f"the {module.isa()} build or this CPU has no AMX-INT8")
    blocks = torch.from_numpy(make_blocks(fmt, 48, k, np.random.default_rng(11)))
    tiled = QuantWeight(blocks, TYPES[fmt], (48, k)).repack()
    tiled.tile_()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    want = module.qlinear(x, tiled.blocks, tiled.qtype, None)
    for rows in (1, 7, 8, 9, 16, 17, 20, 24, 25, 33, 40):
        got = module.qlinear_amx(x[:rows], tiled.blocks, tiled.qtype, None)
        assert torch.equal(got, want[:rows]), rows
    one = torch.cat([module.qlinear(x[m : m + 1], tiled.blocks, tiled.qtype, None) for m in range(40)])
    assert torch.equal(one, want)  # the lanes loop itself: a row's bits whatever its batch
    bias = torch.randn(48, generator=torch.Generator().manual_seed(6))
    assert torch.equal(module.qlinear_amx(x[:12], tiled.blocks, tiled.qtype, bias),
                       module.qlinear(x[:12], tiled.blocks, tiled.qtype, bias))


def test_qlinear_refuses_what_it_cannot_take(module: Any) -> None:
    blocks = torch.from_numpy(make_blocks("Q8_0", 16, 64, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match="unsupported GGUF quantization type"):
        module.qlinear(torch.randn(1, 64), blocks, 99, None)
    with pytest.raises(RuntimeError, match="uint8 blocks"):
        module.qlinear(torch.randn(1, 96), blocks, 8, None)  # rows hold 64 values, not 96
    with pytest.raises(RuntimeError, match="bias"):
        module.qlinear(torch.randn(1, 64), blocks, 8, torch.zeros(3))


@pytest.mark.parametrize("formats", [{"*": "Q4_1", "token_embd": "Q8_0"},
                                     {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q4_0"},
                                     {"*": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q4_K"},
                                     {"*": "Q4_K", "attn_v": "Q8_0", "ffn_up": "Q5_0", "token_embd": "Q4_0"},
                                     {"*": "IQ4_XS", "attn_v": "IQ4_NL", "ffn_up": "IQ4_NL", "token_embd": "IQ4_NL"}],
                         ids=["q4_1", "q4_k_m-like", "q5_k_m-like", "k-quants-with-32-value-formats", "iq4"])
def test_decoder_on_quantized_weights_matches_the_op_by_op_pass(module: Any, formats: dict[str, str],
                                                                tmp_path: Path, byte_level_tokenizer: Any,
                                                                engine_factory: Any) -> None:
    """Every decode step of a batched greedy run, computed op by op (float32 activations, the weights dequantized
    in L1) and by the decoder (int8 activations); a row decoding alone gets the same bits as in the batch. The
    Q4_K_M-like mix makes q/k/v and the MLP matmuls of two formats each: the decoder takes them as parts; with a
    K-quant and a 32-value format in one projection, its parts share the input quantized both ways (blocks of 256
    and of 32)."""
    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, formats, vocab=vocab + (-vocab) % 32)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    engine = engine_factory(Loaded(model, byte_level_tokenizer, 128), kv_cache_bytes=8 << 20, block_size=4,
                            cpu_kernels=False, model_impl="llama", kv_cache_dtype="float32")  # the decoder's below
    factory = lambda *args: module.LlamaDecoder_float32(*args, False)  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    steps = decoder_against_op_by_op(engine, factory, {f"r{i}": (list(range(3 + 5 * i, 10 + 9 * i)), params)
                                                       for i in range(3)}, follow="reference")
    assert len(steps) >= 4 and all(step.batch_invariant for step in steps), "a row changed with its batch mates"
    errors = [step.error for step in steps]
    assert max(errors) <= 5e-2, errors
    picks = [(a, b) for step in steps for a, b in zip(step.got.argmax(-1).tolist(),
                                                      step.reference.argmax(-1).tolist(), strict=True)]
    assert sum(a == b for a, b in picks) >= 0.8 * len(picks), picks
