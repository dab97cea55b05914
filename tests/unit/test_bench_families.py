"""scripts/bench_families.py without llama.cpp: the random-weight GGUF it writes (a small shape, the bundled model's
tokenizer) holds the shape's tensors and the tokenizer's keys, and the rows it prints pair the two servers' runs."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
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
    def row(conc: int, tok_s: float, ttft_ms: float, tpot_ms: float) -> dict:
        return {"concurrency": conc, "output_throughput": tok_s, "ttft_ms": {"p50": ttft_ms},
                "tpot_ms": {"p50": tpot_ms}}

    result = {"runs": [{"peer": "peregrine", "rows": [row(1, 30.0, 100.0, 20.0), row(16, 90.0, 900.0, 150.0)],
                        "peak_rss_mb": 120.0},
                       {"peer": "llamacpp", "rows": [row(1, 20.0, 200.0, 25.0), row(16, 60.0, 3000.0, 200.0)]}],
              "meta": {"machine": {"read_gb_s": 0.0}}}  # fmt: skip
    file = tmp_path / "x.gguf"
    file.write_bytes(b"\0" * 1000)
    rows = bench_families.summarize("s", "Q4_K_M", file, result)
    assert [(r["concurrency"], r["ratio"]) for r in rows] == [(1, 1.5), (16, 1.5)]
    assert rows[1]["ttft_peregrine"] == pytest.approx(0.9) and rows[1]["ttft_llamacpp"] == pytest.approx(3.0)
    assert (rows[0]["tpot_peregrine"], rows[0]["tpot_llamacpp"]) == (20.0, 25.0)
    assert rows[0]["roofline_peregrine"] is None  # no read bandwidth measured: no roofline (the file is not read)
    assert (rows[0]["rss_peregrine"], rows[0]["rss_llamacpp"]) == (120.0, None)  # a run without the figure: None
    assert rows[0]["rss_now_peregrine"] is None


def test_the_roofline_counts_the_weights_a_step_reads(tmp_path: Path) -> None:
    """A tied file's embedding is its LM head (read whole each step); an untied file's embedding is one row a step,
    so only its output matrix counts. The share is the decode rate (1 / TPOT p50) times those bytes over the read
    bandwidth, at one stream only."""
    tied = bench_families.Shape("qwen3", 64, 2, 128, 4, 2, 32, "bundled", 1e6, qk_norm=True)
    path = tmp_path / "tiny-F16.gguf"
    bench_families.write_f16("tiny", tied, path, bench_peers.bundled_gguf())
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert bench_families.weight_bytes_a_token(path) == sum(sizes.values())
    untied = tmp_path / "untied.gguf"
    writer = gguf.GGUFWriter(untied, "llama")
    for name, rows in (("token_embd.weight", 100), ("output.weight", 100), ("blk.0.attn_q.weight", 16)):
        writer.add_tensor(name, np.zeros((rows, 16), dtype=np.float16))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert bench_families.weight_bytes_a_token(untied) == (100 + 16) * 16 * 2  # the output matrix and the layer

    row = {"concurrency": 1, "output_throughput": 40.0, "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 10.0}}
    theirs = row | {"tpot_ms": {"p50": 20.0}}
    result = {"runs": [{"peer": "peregrine", "rows": [row]}, {"peer": "llamacpp", "rows": [theirs]}],
              "meta": {"machine": {"read_gb_s": 2.0}}}
    (one,) = bench_families.summarize("tiny", "F16", path, result)
    step = bench_families.weight_bytes_a_token(path)
    assert one["roofline_peregrine"] == pytest.approx(step * 100 / 2e9)  # 100 steps a second
    assert one["roofline_llamacpp"] == pytest.approx(step * 50 / 2e9)
    # each server's own bandwidth sample (bench.py takes one just before each run) over the one at the file's start
    result["runs"][0]["read_gb_s"], result["runs"][1]["read_gb_s"] = 4.0, 1.0
    (one,) = bench_families.summarize("tiny", "F16", path, result)
    assert one["roofline_peregrine"] == pytest.approx(step * 100 / 4e9) and one["read_gb_s"] == 4.0
    assert one["roofline_llamacpp"] == pytest.approx(step * 50 / 1e9) and one["read_gb_s_llamacpp"] == 1.0


def test_fused_windowed_and_padded_shapes_are_written_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    """Phi-3.5's fused q/k/v and gate/up with its longrope factors and keys; Gemma 3's sandwich norms, window and a
    vocabulary padded to the real model's rows."""
    phi = bench_families.Shape("phi3", 64, 2, 128, 4, 4, 16, "bundled", 1e4, fused=True, context=1024,
                               original_context=256)  # fmt: skip
    path = tmp_path / "phi-F16.gguf"
    bench_families.write_f16("phi", phi, path, bench_peers.bundled_gguf())
    reader = gguf.GGUFReader(path)
    tensors = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert tensors["blk.0.attn_qkv.weight"] == (64, 3 * 64) and tensors["blk.1.ffn_up.weight"] == (64, 2 * 128)
    assert "blk.0.attn_q.weight" not in tensors and "blk.0.ffn_gate.weight" not in tensors
    assert tensors["rope_factors_long.weight"] == tensors["rope_factors_short.weight"] == (8,)
    assert reader.fields["phi3.rope.scaling.original_context_length"].contents() == 256
    assert reader.fields["phi3.rope.scaling.attn_factor"].contents() == pytest.approx((1 + 1.3863 / 5.5452) ** 0.5, abs=1e-4)
    gemma = bench_families.Shape("gemma3", 64, 2, 128, 2, 1, 32, "bundled", 1e6, qk_norm=True, sandwich=True,
                                 window=16, vocab_rows=60000)  # fmt: skip
    path = tmp_path / "gemma-F16.gguf"
    bench_families.write_f16("gemma", gemma, path, bench_peers.bundled_gguf())
    reader = gguf.GGUFReader(path)
    tensors = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert tensors["token_embd.weight"] == (64, 60000) and len(reader.fields["tokenizer.ggml.tokens"].contents()) == 60000
    assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight", "blk.0.attn_q_norm.weight"} <= set(tensors)
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 16


def test_gemma2_shape_writes_its_soft_caps(tmp_path: Path) -> None:
    gemma2 = bench_families.Shape("gemma2", 64, 2, 128, 2, 1, 32, "bundled", 1e4, sandwich=True, window=16,
                                  softcaps=(50.0, 30.0))  # fmt: skip
    path = tmp_path / "gemma2-F16.gguf"
    bench_families.write_f16("gemma2", gemma2, path, bench_peers.bundled_gguf())
    reader = gguf.GGUFReader(path)
    assert reader.fields["gemma2.attn_logit_softcapping"].contents() == 50.0
    assert reader.fields["gemma2.final_logit_softcapping"].contents() == 30.0
    assert "blk.0.attn_q_norm.weight" not in {t.name for t in reader.tensors}
    assert bench_families.SHAPES["gemma-2-2b"].softcaps == (50.0, 30.0)
