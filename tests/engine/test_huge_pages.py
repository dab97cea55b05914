"""The decode step's weights moved into one buffer on transparent huge pages (engine/backends/huge_pages.py): values, views
and bases kept, storages in the order given, the buffer marked for huge pages; and in the engine, every matmul's
weights in step order in that buffer, with the same greedy tokens as weights left where they were."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from config import tool_cache_dir
from engine.backends import cpu_kernels, huge_pages, quant_kernels
from engine.model.forward import _parts
from engine.types import SamplingParams
from models import gguf_weights
from tests.quant_blocks import write_tiny_gguf
from tests.support import Loaded, run_all, tokens_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")


def _smaps_field(address: int, field: str) -> str | None:
    """`field` of the /proc/self/smaps mapping that holds `address` (None where the kernel does not report it)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_gather_keeps_values_views_and_bases_in_one_marked_buffer() -> None:
    a = torch.randn(100, 37)
    b = torch.randint(0, 255, (40, 612), dtype=torch.uint8)
    rows = b[10:20]  # a view of b
    d = torch.randn(1_500_000).to(torch.bfloat16)  # 3 MB: the buffer spans a whole huge page
    tail = d[5:]  # held only as a view: its base must move too
    before = [t.clone() for t in (a, b, rows, d)]
    moved = huge_pages.gather([a, b, tail], views=[rows])
    assert moved == sum(-(-n // 64) * 64 for n in (100 * 37 * 4, 40 * 612, 3_000_000))
    for t, old in zip((a, b, rows, d), before, strict=True):
        assert torch.equal(t, old)
    assert a.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert b.data_ptr() == a.data_ptr() + 14848 and d.data_ptr() == b.data_ptr() + 40 * 612 + 32  # in order
    assert rows.data_ptr() == b.data_ptr() + 10 * 612 and tail.data_ptr() == d.data_ptr() + 5 * 2
    assert tail._base is d  # the same objects, re-pointed
    eligible = _smaps_field(a.data_ptr(), "THPeligible")
    if eligible is not None:  # (reported since Linux 4.19)
        assert eligible == "1", "the buffer is not marked for transparent huge pages"
    b[10, 0] ^= 1  # still one storage: a write through the base shows in its view
    assert rows[0, 0] == before[1][10, 0] ^ 1


def test_gather_leaves_the_bytes_no_tensor_reads() -> None:
    """Tensors viewing parts of a larger buffer (a GGUF file's, its other tensors copied out when fused) take only
    their spans along, each at its cache-line offset, in the order given."""
    storage = torch.arange(10_000, dtype=torch.int32).to(torch.uint8).untyped_storage()
    first, second, column = (torch.empty(0, dtype=torch.uint8).set_(storage, offset, size, stride)  # no base tensor
                             for offset, size, stride in [(0, (100,), (1,)), (5000, (100,), (1,)), (6003, (20,), (20,))])
    del storage
    moved = huge_pages.gather([second, first], views=[column])
    assert moved == 128 + 128 + 448  # [4992, 5100), [0, 100), [5952, 6384): the 9,400 bytes between stay behind
    assert torch.equal(first, torch.arange(100).to(torch.uint8))
    assert torch.equal(second, torch.arange(5000, 5100).to(torch.uint8))
    assert torch.equal(column, torch.arange(6003, 6400, 20).to(torch.uint8))
    assert second.data_ptr() % huge_pages.HUGE_PAGE == 5000 % 64 and first.data_ptr() > second.data_ptr()
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # one buffer now


def test_a_storage_someone_else_views_keeps_its_bytes() -> None:
    """A storage's copied pieces are given back to the OS only when the tensors gather was handed are all its users:
    a view it was not told about still reads the old storage's values, never the zeros of a given-back page."""
    whole = (torch.arange(3 << 20, dtype=torch.int64) % 251).to(torch.uint8)  # 3 MiB: pieces of whole pages
    unknown = whole[1 << 20 : (1 << 20) + 8192]  # not among the tensors gather is given
    expected = unknown.clone()
    assert huge_pages.gather([whole], views=[]) == 3 << 20
    assert torch.equal(unknown, expected) and unknown.data_ptr() != whole.data_ptr() + (1 << 20)
    assert torch.equal(whole, (torch.arange(3 << 20, dtype=torch.int64) % 251).to(torch.uint8))


def test_gather_of_nothing_moves_nothing() -> None:
    assert huge_pages.gather([], views=[torch.ones(3)]) == 0


@pytest.mark.timeout(900)
def test_engine_decode_weights_in_step_order_with_the_same_tokens(tmp_path: Path, byte_level_tokenizer: Any,
                                                                  engine_factory: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_kernels.load(tool_cache_dir()) is None or quant_kernels.load(tool_cache_dir()) is None:
        pytest.skip("no C++ compiler: no one-call decode step")
    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, {"*": "Q4_1", "token_embd": "Q8_0"}, vocab=vocab + (-vocab) % 32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {f"r{i}": (list(range(3 + 5 * i, 10 + 9 * i)), params) for i in range(3)}

    def run() -> tuple[dict[str, list[int]], Any]:
        model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
        engine = engine_factory(Loaded(model, byte_level_tokenizer, 128), kv_cache_bytes=8 << 20, block_size=4,
                                model_impl="llama")
        outputs = run_all(engine, requests)
        return {r: tokens_of(outputs[r]) for r in requests}, engine.runner._forward

    tokens, fast = run()
    assert fast._decoder is not None, "the one-call decode step did not run"
    layers = fast.layers
    order = [t for w in layers for weight in (w.qkv, w.o, w.gate_up, w.down) for t in _parts(weight)[0]]
    order += _parts(fast.model.lm_head.qweight)[0]
    starts = [t.data_ptr() for t in order]
    assert starts[0] % huge_pages.HUGE_PAGE == 0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    for t, following in zip(order, starts[1:], strict=False):
        assert following - t.data_ptr() == -(-t.nbytes // 64) * 64  # back to back
    q_proj = fast.model.model.layers[0].self_attn.q_proj
    assert q_proj.qweight.blocks.data_ptr() == starts[0]  # the modules' own slices moved with the fused weight

    monkeypatch.setattr(huge_pages, "gather", lambda tensors, views: 0)  # weights left where they were
    unmoved, _ = run()
    assert unmoved == tokens


def test_a_second_forward_reuses_the_fused_weights(tmp_path: Path, byte_level_tokenizer: Any) -> None:
    """weight format auto builds a forward per probe, then the served one over the same model: q/k/v and gate/up,
    fused by the first, already lie back to back, so later ones take them as they are instead of copying again
    (a copy would leave the first's fused bytes resident, unread)."""
    from engine.model.forward import LlamaFastForward
    from engine.model.quant import stack_rows

    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, {"*": "Q4_1", "token_embd": "Q8_0"}, vocab=vocab + (-vocab) % 32)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    first, second = LlamaFastForward(model), LlamaFastForward(model)
    for a, b in zip(first.layers, second.layers, strict=True):
        assert b.qkv.blocks.data_ptr() == a.qkv.blocks.data_ptr() and torch.equal(b.qkv.blocks, a.qkv.blocks)
        assert b.gate_up.blocks.data_ptr() == a.gate_up.blocks.data_ptr()
    rows = torch.arange(12.0).reshape(6, 2)
    apart = stack_rows([rows[4:], rows[:2]])  # not in order: a copy
    assert apart.data_ptr() != rows.data_ptr() and torch.equal(apart, rows[[4, 5, 0, 1]])
    assert stack_rows([rows[:2], rows[2:5]]).data_ptr() == rows.data_ptr()


def test_decode_weight_bytes_are_the_files_matmul_tensors(tmp_path: Path, byte_level_tokenizer: Any) -> None:
    """What scripts/bench_engine.py's roofline divides the bandwidth by: a decode step reads every matmul's weights
    as the file stores them (Q4_1 layers, the Q8_0 table as the tied LM head), not the norms or the embedding table."""
    import gguf

    from engine.model.forward import LlamaFastForward

    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, {"*": "Q4_1", "token_embd": "Q8_0"}, vocab=vocab + (-vocab) % 32)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors}
    matmuls = sum(n for name, n in tensors.items() if name.startswith("blk.") and "norm" not in name)
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    assert LlamaFastForward(model).decode_weight_bytes() == matmuls + head
