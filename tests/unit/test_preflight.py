"""Preflight arithmetic with injected figures, and the metadata readers on small files made here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from models import memory, preflight
from models.memory import KVShape, ModelFootprint
from models.preflight import Disk, Need, Resources

GB = 10**9

# A 7.5B-parameter model with a Llama-3-8B-like attention: 32 layers, 8 KV heads of 128.
BIG = ModelFootprint(param_count=7_500_000_000, kv=KVShape(32, 8, 128), context_len=8192)


def test_fmt_bytes() -> None:
    assert memory.fmt_bytes(16_100_000_000) == "16.1 GB"
    assert memory.fmt_bytes(538_090_408) == "538.1 MB"
    assert memory.fmt_bytes(999) == "999 B"
    assert memory.fmt_bytes(2.5e12) == "2.5 TB"


def test_kv_need_is_one_full_sequence_or_the_explicit_size() -> None:
    per_token_bf16 = 2 * 32 * 8 * 128 * 2  # 131072 bytes
    assert memory.kv_cache_need(BIG, "bfloat16", None, None) == per_token_bf16 * 8192
    assert memory.kv_cache_need(BIG, "bfloat16", 1024, None) == per_token_bf16 * 1024
    assert memory.kv_cache_need(BIG, "bfloat16", 1024, 4 * GB) == 4 * GB  # explicit and larger: that
    assert (
        memory.kv_cache_need(BIG, "bfloat16", None, 1) == per_token_bf16 * 8192
    )  # explicit but smaller: the minimum


def test_memory_need_counts_weights_in_the_serving_dtype() -> None:
    bf16, words = memory.memory_need(BIG, "bfloat16", max_model_len=None, kv_cache_bytes=None)
    fp32, _ = memory.memory_need(BIG, "float32", max_model_len=None, kv_cache_bytes=None)
    assert bf16 == 15 * GB + 131072 * 8192
    assert fp32 == 30 * GB + 2 * 131072 * 8192
    assert words == "weights 15.0 GB in bfloat16 + KV cache 1.1 GB for 8192 tokens"


def test_memory_need_counts_the_kv_cache_in_kv_cache_dtype() -> None:
    fp32, words = memory.memory_need(BIG, "float32", max_model_len=None, kv_cache_bytes=None, kv_dtype="float16")
    assert fp32 == 30 * GB + 131072 * 8192  # float32 weights, a float16 cache: half the float32 cache's bytes
    assert words == "weights 30.0 GB in float32 + KV cache 1.1 GB for 8192 tokens in float16"
    same, _ = memory.memory_need(BIG, "bfloat16", max_model_len=None, kv_cache_bytes=None, kv_dtype="auto")
    assert same == 15 * GB + 131072 * 8192
    # what --kv-cache-dtype float16 changes in the verdict: 31.1 GB fits where the float32 cache's 32.1 GB does not
    res = Resources(ram_free=int(31.5 * GB))
    assert not preflight.check(BIG, res, dtype="float32", on_cuda=False)[0].ok
    assert preflight.check(BIG, res, dtype="float32", on_cuda=False, kv_dtype="float16")[0].ok


def test_refuses_with_the_arithmetic_when_ram_is_short() -> None:
    res = Resources(ram_free=int(9.8 * GB))
    needs = preflight.check(BIG, res, dtype="bfloat16", on_cuda=False)
    assert [n.ok for n in needs] == [False]
    message = preflight.refusal(needs)
    assert message == (
        "the model does not fit: needs 16.1 GB (weights 15.0 GB in bfloat16 + KV cache 1.1 GB for 8192 tokens), "
        "9.8 GB free in RAM (--skip-preflight to start anyway)"
    )


def test_fits_when_there_is_room() -> None:
    needs = preflight.check(BIG, Resources(ram_free=64 * GB), dtype="bfloat16", on_cuda=False)
    assert all(n.ok for n in needs) and preflight.refusal(needs) is None


def test_cuda_checks_vram_not_ram() -> None:
    res = Resources(ram_free=1 * GB, vram_free=80 * GB)
    needs = preflight.check(BIG, res, dtype="bfloat16", on_cuda=True, device_label="cuda:0")
    assert [(n.where, n.ok) for n in needs] == [("in VRAM on cuda:0", True)]
    short = preflight.check(BIG, Resources(ram_free=64 * GB, vram_free=12 * GB), dtype="bfloat16", on_cuda=True,
                            device_label="cuda:1")  # fmt: skip
    assert "12.0 GB free in VRAM on cuda:1" in (preflight.refusal(short) or "")


def test_a_shorter_context_makes_it_fit() -> None:
    res = Resources(ram_free=int(15.5 * GB))
    assert preflight.refusal(preflight.check(BIG, res, dtype="bfloat16", on_cuda=False)) is not None
    fits = preflight.check(BIG, res, dtype="bfloat16", on_cuda=False, max_model_len=2048)
    assert preflight.refusal(fits) is None


def test_disk_for_download_on_its_filesystem() -> None:
    fp = ModelFootprint(10, KVShape(1, 1, 1), 16, download_bytes=16_100_000_000)
    disks = (Disk("/data/hf", int(9.8 * GB), fs=1), Disk("/home/u/.cache/peregrine", 100 * GB, fs=2))
    needs = preflight.check(fp, Resources(ram_free=64 * GB, disks=disks), dtype="float32", on_cuda=False,
                            download_dir="/data/hf", cache_dir="/home/u/.cache/peregrine")  # fmt: skip
    refusal = preflight.refusal(needs)
    assert refusal is not None and "needs 16.1 GB (download 16.1 GB), 9.8 GB free on /data/hf" in refusal


def test_download_and_conversion_on_one_filesystem_add_up() -> None:
    fp = ModelFootprint(10, KVShape(1, 1, 1), 16, download_bytes=3 * GB, convert_bytes=4 * GB)
    disks = (Disk("/a", 6 * GB, fs=7), Disk("/b", 6 * GB, fs=7))
    needs = preflight.check(fp, Resources(ram_free=64 * GB, disks=disks), dtype="float32", on_cuda=False,
                            download_dir="/a", cache_dir="/b")  # fmt: skip
    disk_need = next(n for n in needs if n.where.startswith("on "))
    assert disk_need == Need(7 * GB, 6 * GB, "on /a and /b", "download 3.0 GB + GGUF conversion cache 4.0 GB")
    assert not disk_need.ok


def test_nothing_to_download_needs_no_disk() -> None:
    fp = ModelFootprint(10, KVShape(1, 1, 1), 16)
    needs = preflight.check(fp, Resources(ram_free=GB, disks=(Disk("/a", 0, fs=1),)), dtype="float32",
                            on_cuda=False, download_dir="/a", cache_dir="/a")  # fmt: skip
    assert [n.where for n in needs] == ["in RAM"]


def test_gguf_conversion_needs_float32_in_ram() -> None:
    fp = ModelFootprint(1_000_000_000, KVShape(1, 1, 1), 16, convert_bytes=4 * GB)
    needs = preflight.check(fp, Resources(ram_free=3 * GB), dtype="bfloat16", on_cuda=False)
    failed = [n for n in needs if not n.ok]
    assert [n.breakdown for n in failed] == ["one-time GGUF conversion to float32"]


def test_kv_shape_from_config_variants() -> None:
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "max_position_embeddings": 131072}  # fmt: skip
    assert preflight.kv_shape_from_config(llama) == (KVShape(32, 8, 128), 131072)
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
    assert preflight.kv_shape_from_config(gpt2) == (KVShape(12, 12, 64), 1024)
    explicit_head = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 256, "hidden_size": 64}
    assert preflight.kv_shape_from_config(explicit_head) == (KVShape(2, 4, 256), 2048)
    nested = {"text_config": llama, "vision_config": {}}
    assert preflight.kv_shape_from_config(nested) == (KVShape(32, 8, 128), 131072)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A valid safetensors file with zeroed data (no torch needed)."""
    sizes = {"F32": 4, "BF16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(offset))


def test_folder_footprint_counts_parameters_from_headers(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "max_position_embeddings": 512}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [64, 64]), "b": ("BF16", [64])}
    )
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": ("F32", [10, 3])})
    fp = preflight.folder_footprint(tmp_path)
    assert fp == ModelFootprint(64 * 64 + 64 + 30, KVShape(2, 2, 16), 512)


def test_folder_footprint_from_pytorch_bin_sizes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "hidden_size": 8, "torch_dtype": "float16"})
    )
    (tmp_path / "pytorch_model.bin").write_bytes(bytes(2000))
    assert preflight.folder_footprint(tmp_path).param_count == 1000


def write_gguf(path: Path, *, arch: str = "llama") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(3)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_token_list(["<s>", "</s>", "hello"])  # an array of strings, skipped by the reader
    writer.add_tensor("token_embd.weight", np.zeros((10, 256), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, 256), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_header_reader_and_footprint(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    meta, shapes = preflight.read_gguf_header(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 3
    assert "tokenizer.ggml.tokens" not in meta
    assert set(shapes) == {"token_embd.weight", "blk.0.attn_q.weight"}
    fp = preflight.gguf_footprint(path, cached=False)
    params = 10 * 256 + 256 * 256
    assert fp == ModelFootprint(params, KVShape(3, 2, 32), 4096, convert_bytes=params * 4)
    assert preflight.gguf_footprint(path, cached=True).convert_bytes == 0


def test_gguf_reader_refuses_other_files(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        preflight.read_gguf_header(bogus)


def test_hub_footprint_prefers_the_hubs_parameter_count() -> None:
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "hidden_size": 8,
        "max_position_embeddings": 64,
    }
    files = {"model.safetensors": 2000, "config.json": 100}
    assert preflight.hub_footprint(123, files, 2100, config).param_count == 123
    fallback = preflight.hub_footprint(None, files, 2100, config | {"torch_dtype": "bfloat16"})
    assert (fallback.param_count, fallback.download_bytes) == (1000, 2100)


def test_disk_of_a_directory_not_created_yet(tmp_path: Path) -> None:
    disk = preflight.disk_of(tmp_path / "not" / "yet")
    assert disk.path == str(tmp_path / "not" / "yet")
    assert disk.fs == os.stat(tmp_path).st_dev and disk.free > 0


def test_measure_resources_reads_ram_and_disks(tmp_path: Path) -> None:
    res = preflight.measure_resources([tmp_path])
    assert res.ram_free > 0 and res.vram_free is None
    assert [d.path for d in res.disks] == [str(tmp_path)]


def test_main_refuses_a_model_that_does_not_fit_before_loading(tmp_path: Path, tiny_model_dir) -> None:  # noqa: ANN001
    """End to end through main.py: the refusal shows the arithmetic, exits 1, and loads nothing."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEREGRINE_")}
    cmd = [sys.executable, str(repo / "main.py"), "--model", str(tiny_model_dir.path), "--device", "cpu",
           "--dtype", "float32", "--kv-cache-bytes", "900TB", "--embedding-model", "none"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "the model does not fit: needs 900.0 TB (weights " in result.stderr
    assert "free in RAM (--skip-preflight to start anyway)" in result.stderr
    assert "Traceback" not in result.stderr and "listening on" not in result.stderr


def test_the_amx_decoders_packed_copy_counts_on_cpu_only() -> None:
    """With AMX, the one-call decode step keeps a packed copy of the weights: RAM for it is asked for on CPU."""
    res = Resources(ram_free=20 * GB, vram_free=20 * GB)
    plain = preflight.check(BIG, res, dtype="bfloat16", on_cuda=False)
    packed = preflight.check(BIG, res, dtype="bfloat16", on_cuda=False, packed_copy=True)
    assert [n.ok for n in plain] == [True] and [n.ok for n in packed] == [False]
    assert packed[0].needed == plain[0].needed + 15 * GB
    assert packed[0].breakdown.endswith("+ 15.0 GB packed copy for AMX decode steps")
    on_gpu = preflight.check(BIG, res, dtype="bfloat16", on_cuda=True, packed_copy=True)
    assert on_gpu[0].needed == plain[0].needed


def test_dtype_auto_counts_the_probes_float32_and_bfloat16_copies() -> None:
    """--dtype auto on CPU holds float32 weights and a bfloat16 copy while it times both (models/autotune/dtype.py)."""
    auto, words = memory.memory_need(BIG, "auto", max_model_len=None, kv_cache_bytes=None)
    fp32, _ = memory.memory_need(BIG, "float32", max_model_len=None, kv_cache_bytes=None)
    assert auto == fp32 + 15 * GB
    assert words == "weights 30.0 GB in float32 + KV cache 2.1 GB for 8192 tokens + 15.0 GB bfloat16 copy timed by " \
                    "--dtype auto"
    room = {"max_model_len": None, "kv_cache_bytes": None}
    assert memory.auto_cpu_dtypes(BIG, auto, **room) == (("float32", "bfloat16"), "")
    dtypes, why = memory.auto_cpu_dtypes(BIG, auto - 1, **room)
    assert dtypes == ("bfloat16",) and why.startswith("float32 not tried: timing it needs 47.1 GB (weights 30.0 GB")


def test_dtype_auto_is_checked_as_bfloat16_alone_when_float32_cannot_be_timed() -> None:
    roomy = preflight.check(BIG, Resources(ram_free=64 * GB), dtype="auto", on_cuda=False)
    tight = preflight.check(BIG, Resources(ram_free=20 * GB), dtype="auto", on_cuda=False)
    assert roomy[0].ok and "in float32" in roomy[0].breakdown and "bfloat16 copy" in roomy[0].breakdown
    assert tight[0].ok and tight[0].breakdown == "weights 15.0 GB in bfloat16 + KV cache 1.1 GB for 8192 tokens"


AMX_FLAGS = "fpu avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16"


def test_cpu_has_amx_reads_the_flags(tmp_path: Path) -> None:
    with_amx, without = tmp_path / "a", tmp_path / "b"
    with_amx.write_text(f"flags\t\t: {AMX_FLAGS}\n")
    without.write_text("flags\t\t: fpu avx2 fma f16c avx512f\n")
    assert preflight.cpu_has_amx(with_amx) and not preflight.cpu_has_amx(without)
    assert not preflight.cpu_has_amx(tmp_path / "missing")


def test_cpu_has_amx_follows_the_isa_ceiling(tmp_path: Path) -> None:
    with_amx = tmp_path / "a"
    with_amx.write_text(f"flags\t\t: {AMX_FLAGS}\n")
    assert preflight.cpu_has_amx(with_amx, cpu_isa="amx")
    assert not preflight.cpu_has_amx(with_amx, cpu_isa="avx512")  # the packed AMX copy is not counted when hidden
    assert not preflight.packed_copy_kept("cpu", True, "avx512")  # the cap (EngineConfig.cpu_isa) reaches it


# A 7.5B GGUF kept quantized (about 4.4 GB of Q4 blocks): --weight-format auto may time dense copies beside it.
QUANT = ModelFootprint(param_count=7_500_000_000, kv=KVShape(32, 8, 128), context_len=8192,
                       weight_bytes=4_400_000_000)


def test_weight_format_auto_counts_the_dense_copies_it_times_only_where_they_fit() -> None:
    room = {"max_model_len": None, "kv_cache_bytes": None}
    quantized, words = memory.memory_need(QUANT, "float32", **room)  # 4.4 GB + KV cache 1.1 GB (float16)
    assert "KV cache 1.1 GB for 8192 tokens in float16" in words  # quantized weights: the cache in float16
    both = quantized + 30 * GB + 15 * GB
    assert memory.auto_weight_formats(QUANT, both, ("float32", "bfloat16"), **room) == (("float32", "bfloat16"), "")
    tried, why = memory.auto_weight_formats(QUANT, both - 1, ("float32", "bfloat16"), **room)
    assert tried == ("bfloat16",) and why.startswith("dense float32 not tried: timing it needs 50.5 GB (weights 4.4 GB")
    tried, why = memory.auto_weight_formats(QUANT, quantized + 15 * GB - 1, ("float32", "bfloat16"), **room)
    assert tried == () and why.startswith("dense float32 and bfloat16 not tried")
    assert memory.auto_weight_formats(QUANT, quantized + 30 * GB, ("float32",), **room) == (("float32",), "")
    # the preflight: the probe's peak when dense is tried; the quantized need alone (no refusal) when it is not
    roomy = preflight.check(QUANT, Resources(ram_free=64 * GB), dtype="auto", on_cuda=False,
                            dense=("float32", "bfloat16"))
    tight = preflight.check(QUANT, Resources(ram_free=10 * GB), dtype="auto", on_cuda=False,
                            dense=("float32", "bfloat16"))
    assert roomy[0].ok and roomy[0].needed == both
    assert roomy[0].breakdown.endswith("+ 30.0 GB dense float32 copy if --weight-format auto times it + 15.0 GB "
                                       "dense bfloat16 copy if --weight-format auto times it")
    assert tight[0].ok and tight[0].needed == quantized and "dense" not in tight[0].breakdown
    assert preflight.check(QUANT, Resources(ram_free=64 * GB), dtype="auto", on_cuda=False)[0].needed == quantized
