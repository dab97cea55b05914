"""scripts/bench_families.py without llama.cpp: the random-weight GGUF it writes (a small shape, the bundled model's
tokenizer) holds the shape's tensors and the tokenizer's keys, and the rows it prints pair the two servers' runs."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_families  # noqa: E402
import bench_peers  # noqa: E402


def test_a_written_shape_has_its_tensors_and_the_tokenizer(tmp_path: Path) -> None:
    shape = bench_families.Shape("qwen3", 64, 2, 128, 4, 2, 32, "bundled", 1e6, qk_norm=True)
    path = tmp_path / "tiny-F16.gguf"
    bench_families.write_f16("tiny", shape, path, bench_peers.bundled_gguf())
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors}
    vocab = len(gguf.GGUFReader(bench_peers.bundled_gguf()).fields["tokenizer.ggml.tokens"].contents())
    assert tensors["token_embd.weight"] == ((64, vocab), "F16")  # GGUF lists the fastest dimension first
    assert tensors["blk.1.attn_q.weight"] == ((64, 128), "F16") and tensors["blk.0.attn_k.weight"][0] == (64, 64)
    assert tensors["blk.1.ffn_down.weight"] == ((128, 64), "F16") and "blk.1.attn_k_norm.weight" in tensors
    assert len(tensors) == 2 + 2 * (7 + 2 + 2) and "output.weight" not in tensors  # tied, as the real model
    fields = reader.fields
    assert fields["general.architecture"].contents() == "qwen3" and fields["qwen3.block_count"].contents() == 2
    assert fields["tokenizer.chat_template"].contents() and len(fields["tokenizer.ggml.tokens"].contents()) == vocab


def test_rows_pair_the_servers_at_each_level(tmp_path: Path) -> None:
    def row(conc: int, tok_s: float, ttft_ms: float) -> dict:
        return {"concurrency": conc, "output_throughput": tok_s, "ttft_ms": {"p50": ttft_ms}}

    result = {"runs": [{"peer": "peregrine", "rows": [row(1, 30.0, 100.0), row(16, 90.0, 900.0)], "peak_rss_mb": 120.0},
                       {"peer": "llamacpp", "rows": [row(1, 20.0, 200.0), row(16, 60.0, 3000.0)]}]}  # fmt: skip
    file = tmp_path / "x.gguf"
    file.write_bytes(b"\0" * 1000)
    rows = bench_families.summarize("s", "Q4_K_M", file, result)
    assert [(r["concurrency"], r["ratio"]) for r in rows] == [(1, 1.5), (16, 1.5)]
    assert rows[1]["ttft_peregrine"] == pytest.approx(0.9) and rows[1]["ttft_llamacpp"] == pytest.approx(3.0)
    assert (rows[0]["rss_peregrine"], rows[0]["rss_llamacpp"]) == (120.0, None)  # a run without the figure: None
