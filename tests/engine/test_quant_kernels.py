"""Peregrine's kernels for quantized weights (engine/backends/csrc/quant.cpp) against gguf's numpy dequantization + torch's
matmul, for every format, every ISA variant this CPU runs, and decode-size (1, 3, 16) and prefill-size (64) rows.

Bounds: dequantization is exact (the same float32 arithmetic as ggml's reference up to one rounding of q * d + m);
the matmul differs from torch's only in summation order: |error| <= 1e-5 * sum |x| |w| per output (float32's
epsilon times the length of the dot product, with margin)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from config import tool_cache_dir
from engine.backends import cpu_features, quant_kernels
from engine.model.quant import QuantWeight
from tests.quant_blocks import FORMATS, dequantize, make_blocks

pytestmark = pytest.mark.timeout(900)  # the first run compiles each variant (about a minute each on 2 cores)
VARIANTS = ("none", "avx2", "avx512")
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23}


def kernels(variant: str):  # noqa: ANN201 - a compiled extension module
    if variant not in quant_kernels.runnable_variants():
        pytest.skip(f"this CPU cannot run the {variant} variant")
    module = quant_kernels.load(tool_cache_dir(), variant)
    if module is None:
        pytest.skip("no C++ compiler: the kernels did not build")
    assert module.isa() == variant
    return module


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(16)
    out = {}
    for fmt in FORMATS:
        blocks = make_blocks(fmt, 40, 512, rng)  # 40 rows: not a multiple of the kernel's 4-row tiles
        out[fmt] = (torch.from_numpy(blocks.copy()), torch.from_numpy(dequantize(blocks, fmt)))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantize_matches_gguf(variant: str, weights: dict) -> None:
    module = kernels(variant)
    for fmt, (blocks, dense) in weights.items():
        got = module.dequantize(blocks, TYPE_IDS[fmt], 512)
        torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-7, msg=f"{fmt} dequantized")


@pytest.mark.parametrize("variant", VARIANTS)
def test_linear_matches_dequantize_then_matmul(variant: str, weights: dict) -> None:
    module = kernels(variant)
    torch.manual_seed(0)
    for fmt, (blocks, dense) in weights.items():
        for rows in (1, 3, 16):
            x = torch.randn(rows, 512)
            bound = 1e-5 * (x.abs() @ dense.abs().T)
            error = (module.linear(x, blocks, TYPE_IDS[fmt]) - x @ dense.T).abs()
            assert (error <= bound + 1e-6).all(), f"{fmt}, {rows} rows: max error {error.max():.3g}"


def test_rows_are_batch_invariant(weights: dict) -> None:
    """Each output row is the same whatever else is in the batch (the same sums in the same order), with the kernels
    a backend hands over (the op-by-op pass; the one-call step has its own test, tests/engine/test_batch_invariance.py)."""
    module = quant_kernels.load(tool_cache_dir())
    if module is None:
        pytest.skip("no C++ compiler: the kernels did not build")
    x = torch.randn(40, 512)  # more rows than the kernel takes at once
    for fmt, (blocks, _) in weights.items():
        weight = QuantWeight(blocks, TYPE_IDS[fmt], (40, 512), module)
        alone = torch.cat([weight.matmul(x[i : i + 1]) for i in range(40)])
        assert torch.equal(weight.matmul(x), alone), fmt


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_quant_weight_matmul_all_paths(rows: int, weights: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """QuantWeight.matmul with the kernels a backend hands over (max_rows rows at a time), and without them
    (`--cpu-kernels off`: tiles of dequantized rows into torch's GEMM, forced small here so several are used);
    bf16 inputs answered in bf16."""
    module = quant_kernels.load(tool_cache_dir())
    if module is None:
        pytest.skip("no C++ compiler: the kernels did not build")
    monkeypatch.setattr("engine.model.quant.PREFILL_TILE_ELEMS", 512 * 16)
    x = torch.randn(rows, 512)
    for fmt, (blocks, dense) in weights.items():
        for kernels in (module, None):
            weight = QuantWeight(blocks, TYPE_IDS[fmt], (40, 512), kernels)
            torch.testing.assert_close(weight.matmul(x), x @ dense.T, rtol=1e-4, atol=1e-4)
            assert weight.matmul(x.bfloat16()).dtype == torch.bfloat16


def test_variant_follows_the_isa_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ISA cap (EngineConfig.cpu_isa) hides features: the server then loads the smaller variant (CI runs AVX2 on
    AVX-512)."""
    assert quant_kernels.variant(cap="none") == "none"
    assert quant_kernels.variant(cap="avx2") == ("avx2" if "avx2" in quant_kernels.runnable_variants() else "none")
    assert quant_kernels.variant("amx") == quant_kernels.variant("avx512_bf16") == "avx512"
    assert quant_kernels.variant("avx512") == "avx512"
    assert quant_kernels.variant("avx_vnni") == "avx2"  # this module has no int8 dot products: AVX2's build


def test_runnable_variants_need_every_flag_of_their_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """The avx512 variant is built with VNNI's flag: an AVX-512 CPU without it (Skylake-SP) runs only the others;
    one without BF16 (Ice Lake) runs it."""
    skylake = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})
    for flags, expected in [(frozenset(), ["none"]), (frozenset({"avx2", "fma", "f16c"}), ["none", "avx2"]),
                            (frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ["none", "avx2"]),
                            (skylake, ["none", "avx2"]),
                            (skylake | {"avx512_vnni"}, ["none", "avx2", "avx512"]),
                            (skylake | {"avx512_bf16", "avx512_vnni"}, ["none", "avx2", "avx512"]),
                            (skylake | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
                             ["none", "avx2", "avx512"])]:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: flags)
        assert quant_kernels.runnable_variants() == expected, sorted(flags)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_row_packed_weights_hold_the_same_values(fmt: str, weights: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`QuantWeight.repack` (Q4_0 / Q4_1 / Q8_0 rows packed for the kernels at load) keeps every bit: `unpack` gives the
    file's blocks back; dequantizing and multiplying the packed rows, by every variant, gives exactly the file's
    results, and so does gguf's numpy reference (no compiler). Rows of an odd number of blocks stay as they are."""
    blocks, dense = weights[fmt]
    plain = QuantWeight(blocks, TYPE_IDS[fmt], (40, 512))
    packed = plain.repack()
    assert packed.qtype == TYPE_IDS[fmt] + 1000 and packed.type_name == fmt and packed.nbytes == plain.nbytes
    assert not torch.equal(packed.blocks, plain.blocks)  # rearranged, not copied
    assert torch.equal(packed.unpack().blocks, blocks) and packed.unpack().qtype == plain.qtype
    x = torch.randn(3, 512)
    for variant in quant_kernels.runnable_variants():
        module = quant_kernels.load(tool_cache_dir(), variant)
        if module is not None:
            dense_packed = module.dequantize(packed.blocks, packed.qtype, 512)
            assert torch.equal(dense_packed, module.dequantize(blocks, plain.qtype, 512))
            assert torch.equal(module.linear(x, packed.blocks, packed.qtype), module.linear(x, blocks, plain.qtype))
    packed.kernels = None  # no compiler (or --cpu-kernels off): gguf's reference, after unpack
    assert torch.equal(packed.dequantize(), dense)
    assert torch.equal(packed.dequantize(torch.tensor([3, 0])), dense[[3, 0]])
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]][1]
    odd = QuantWeight(blocks[:, : 480 // 32 * block_bytes].contiguous(), TYPE_IDS[fmt], (40, 480))
    assert odd.repack() is odd  # 15 blocks a row: not packed
