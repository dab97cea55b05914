"""Will the model fit? Checked before anything is downloaded or loaded, so a start fails in a second with
the arithmetic shown ("needs 16.1 GB (...), 9.8 GB free on /data") rather than after an hour.

Three parts:
  - `ModelFootprint` (models/memory.py): what a model needs, read here from metadata only (safetensors
    headers, GGUF header, config.json, the Hub's file sizes and parameter counts); `*_footprint` build it.
  - `Resources`: what the machine has free (disk per filesystem, RAM, VRAM); `measure_resources` reads it.
  - `check`: the verdict over the two, one `Need` per resource, with models/memory.py's arithmetic.

A GGUF conversion, done once, needs the dense float32 model in RAM and on disk in the cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from models.memory import (
    KVShape,
    ModelFootprint,
    auto_cpu_dtypes,
    auto_weight_formats,
    dtype_bytes,
    fmt_bytes,
    memory_need,
)

# A model config's context length, under the names model families use (the loader reads the same list).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass(frozen=True, slots=True)
class Disk:
    path: str  # the directory that needs space
    free: int  # bytes free on its filesystem
    fs: int  # filesystem id (st_dev): two paths on one filesystem share its free space


@dataclass(frozen=True, slots=True)
class Resources:
    ram_free: int
    disks: tuple[Disk, ...] = ()
    vram_free: int | None = None  # free bytes on the chosen CUDA device; None when not on CUDA


@dataclass(frozen=True, slots=True)
class Need:
    """One resource the model needs, and what is free. `message` is what the user reads on refusal."""

    needed: int
    free: int
    where: str  # "RAM", "VRAM on cuda:0", "on /data"
    breakdown: str  # "weights 15.0 GB in bfloat16 + KV cache 1.1 GB for 8192 tokens"

    @property
    def ok(self) -> bool:
        return self.needed <= self.free

    @property
    def message(self) -> str:
        return f"needs {fmt_bytes(self.needed)} ({self.breakdown}), {fmt_bytes(self.free)} free {self.where}"


# --- the verdict -------------------------------------------------------------------------------------


def check(
    fp: ModelFootprint,
    res: Resources,
    *,
    dtype: str,
    on_cuda: bool,
    device_label: str = "cuda",
    download_dir: str = "",
    cache_dir: str = "",
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    packed_copy: bool = False,
    dense: tuple[str, ...] = (),
    kv_dtype: str = "auto",
) -> list[Need]:
    """Every need against what is free. The model fits when all are `ok`. `dense`: a GGUF kept quantized whose
    `--weight-format auto` would time these dense dtypes: counted only as far as they fit (`auto_weight_formats`)."""
    needs = list(_disk_needs(fp, res.disks, download_dir, cache_dir))
    if dense and not on_cuda and fp.weight_bytes is not None:
        dense, _ = auto_weight_formats(fp, res.ram_free, dense, max_model_len=max_model_len,
                                       kv_cache_bytes=kv_cache_bytes, packed_copy=packed_copy, kv_dtype=kv_dtype)
    if dtype == "auto" and not on_cuda and fp.weight_bytes is None:
        dtypes, _ = auto_cpu_dtypes(fp, res.ram_free, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                                    packed_copy=packed_copy, kv_dtype=kv_dtype)
        dtype = "auto" if len(dtypes) > 1 else "bfloat16"
    total, words = memory_need(fp, dtype, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                               packed_copy=packed_copy and not on_cuda,
                               dense=dense if not on_cuda and fp.weight_bytes is not None else (), kv_dtype=kv_dtype)
    if on_cuda and res.vram_free is not None:
        needs.append(Need(total, res.vram_free, f"in VRAM on {device_label}", words))
    elif not on_cuda:
        needs.append(Need(total, res.ram_free, "in RAM", words))
    if fp.convert_bytes:
        needs.append(Need(fp.convert_bytes, res.ram_free, "in RAM", "one-time GGUF conversion to float32"))
    return needs


def _disk_needs(
    fp: ModelFootprint, disks: Iterable[Disk], download_dir: str, cache_dir: str
) -> Iterable[Need]:
    demands = [
        (download_dir, fp.download_bytes, "download"),
        (cache_dir, fp.convert_bytes, "GGUF conversion cache"),
    ]
    by_path = {d.path: d for d in disks}
    per_fs: dict[int, list[tuple[Disk, int, str]]] = {}
    for path, amount, what in demands:
        if amount and path in by_path:
            per_fs.setdefault(by_path[path].fs, []).append((by_path[path], amount, what))
    for items in per_fs.values():
        words = " + ".join(f"{what} {fmt_bytes(amount)}" for _, amount, what in items)
        paths = " and ".join(dict.fromkeys(disk.path for disk, _, _ in items))
        yield Need(sum(a for _, a, _ in items), items[0][0].free, f"on {paths}", words)


def refusal(needs: Iterable[Need]) -> str | None:
    """The user's message when something does not fit, else None."""
    failed = [n.message for n in needs if not n.ok]
    if not failed:
        return None
    return "the model does not fit: " + "; ".join(failed) + " (--skip-preflight to start anyway)"


def combined(needs: list[Need], more: list[Need], label: str) -> list[Need]:
    """`needs` with a second model's `more` (named `label`: a draft model) added: the first need of each place in
    `more` adds to the first of that place in `needs` (the memory the weights and KV caches share, a download's
    disk); the others (a one-time conversion) stand as needs of their own."""
    out, merged = list(needs), set()
    for need in more:
        at = next((i for i, n in enumerate(out) if n.where == need.where), None) if need.where not in merged else None
        if at is None:
            out.append(Need(need.needed, need.free, need.where, f"{label}: {need.breakdown}"))
            continue
        merged.add(need.where)
        mine = out[at]
        out[at] = Need(mine.needed + need.needed, mine.free, mine.where, f"{mine.breakdown}; {label}: {need.breakdown}")
    return out


# --- reading what the model needs ---------------------------------------------------------------------


def kv_shape_from_config(config: Mapping[str, object]) -> tuple[KVShape, int]:
    """(layers, KV heads, head size) and the context length, from a transformers config.json."""
    cfg = dict(config.get("text_config") or config)  # multimodal configs nest the language model
    layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or cfg.get("n_embd") or 0) // heads)
    context = next((int(cfg[k]) for k in CONTEXT_KEYS if cfg.get(k)), 2048)
    return KVShape(layers, kv_heads, head_dim), context


def safetensors_params(path: Path) -> int:
    """Elements in a .safetensors file, from its JSON header (the weights are not read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(_prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def folder_footprint(folder: Path) -> ModelFootprint:
    """A local transformers folder: parameter count from safetensors headers (or .bin sizes)."""
    config = json.loads((folder / "config.json").read_text())
    kv, context = kv_shape_from_config(config)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        params = sum(safetensors_params(p) for p in shards)
    else:  # PyTorch pickles: size / bytes per element of the stored dtype
        stored = dtype_bytes(str(config.get("torch_dtype") or config.get("dtype") or "float32"), default=4)
        params = sum(p.stat().st_size for p in folder.glob("*.bin")) // stored
    return ModelFootprint(params, kv, context)


def gguf_footprint(path: Path, *, cached: bool, quantized: bool = False) -> ModelFootprint:
    """A .gguf file: tensor element counts and attention shape from its header; a first conversion
    writes the dense float32 weights (cached=False). `quantized`: served as the file holds them
    (models/gguf_weights.py): the weights take their bytes in the file, and nothing is converted."""
    meta, shapes, types = read_gguf_tensors(path)
    params = sum(_prod(shape) for shape in shapes.values())
    arch = str(meta.get("general.architecture", "llama"))

    def get(key: str, default: int) -> int:
        value = meta.get(f"{arch}.{key}", default)
        return int(value) if isinstance(value, (int, float)) else default

    heads = get("attention.head_count", 1)
    head_dim = get("attention.key_length", get("embedding_length", 0) // heads)
    kv = KVShape(get("block_count", 0), get("attention.head_count_kv", heads), head_dim)
    if quantized:
        weight_bytes = sum(gguf_tensor_bytes(shapes[n], types[n]) for n in shapes)
        return ModelFootprint(params, kv, get("context_length", 2048), weight_bytes=weight_bytes)
    return ModelFootprint(params, kv, get("context_length", 2048), convert_bytes=0 if cached else params * 4)


def gguf_tensor_bytes(shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of `ggml_type` (ggml's block sizes, from the gguf package)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return _prod(shape) // per_block * block_bytes


# GGUF metadata value types (GGUF v2/v3): scalar struct formats, 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_header(path: Path) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """Metadata (scalars and strings; arrays are skipped) and tensor shapes from a GGUF file's header."""
    meta, shapes, _ = read_gguf_tensors(path)
    return meta, shapes


def read_gguf_tensors(path: Path) -> tuple[dict[str, object], dict[str, tuple[int, ...]], dict[str, int]]:
    """Metadata, tensor shapes and tensor ggml types from a GGUF file's header.

    Reads only the header, in a fraction of a second: gguf.GGUFReader maps every tokenizer entry into
    numpy and takes tens of seconds on a 50k-token vocabulary.
    """
    layout = read_gguf_layout(path)
    return layout.meta, layout.shapes, layout.types


@dataclass(frozen=True)
class GgufLayout:
    """A GGUF file's header: metadata (scalars and strings; arrays are skipped), each tensor's shape, ggml type and
    offset from `data_start`, where the tensor data begins."""

    meta: dict[str, object]
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, int]
    offsets: dict[str, int]
    data_start: int

    @property
    def data_end(self) -> int:
        """The byte where the last tensor's data ends (past the file's end: the file is truncated); ValueError for
        a tensor type the gguf package does not know."""
        ends = (self.offsets[n] + gguf_tensor_bytes(self.shapes[n], self.types[n]) for n in self.shapes)
        return self.data_start + max(ends, default=0)


def read_gguf_layout(path: Path) -> GgufLayout:
    """The header of a GGUF file, read without mapping its arrays (read_gguf_tensors); ValueError or struct.error
    when it is not a whole GGUF header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic, version = f.read(4), _unpack(f, "<I")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF v2+ file")
        n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = _gguf_string(f, size)
            value = _gguf_value(f, _unpack(f, "<I"), size)
            if value is not None:
                meta[key] = value
        shapes, types, offsets = {}, {}, {}
        for _ in range(n_tensors):
            name = _gguf_string(f, size)
            if name in shapes:
                raise ValueError(f"tensor {name} is in the file twice")
            shapes[name] = tuple(_unpack(f, "<Q") for _ in range(_unpack(f, "<I")))
            types[name] = _unpack(f, "<I")
            offsets[name] = _unpack(f, "<Q")
        alignment = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-f.tell() // alignment) * alignment  # the tensor data begins at the next multiple
    return GgufLayout(meta, shapes, types, offsets, start)


def _gguf_value(f: BinaryIO, vtype: int, size: int) -> object:
    if vtype in _GGUF_SCALARS:
        return _unpack(f, _GGUF_SCALARS[vtype])
    if vtype == _GGUF_STRING:
        return _gguf_string(f, size)
    if vtype == _GGUF_ARRAY:
        item_type, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item_type in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[item_type]) * count, os.SEEK_CUR)
        elif count > size:  # each item takes a byte at least
            raise ValueError(f"an array of {count} items in a file of {size} bytes")
        else:
            for _ in range(count):
                _gguf_value(f, item_type, size)
        return None
    raise ValueError(f"unknown GGUF value type {vtype}")


def _gguf_string(f: BinaryIO, size: int) -> str:
    length = _unpack(f, "<Q")
    if length > size:  # a damaged length: never read (allocate) past the file
        raise ValueError(f"a string of {length} bytes in a file of {size} bytes")
    return f.read(length).decode("utf-8", errors="replace")


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def hub_footprint(
    param_count: int | None, file_sizes: Mapping[str, int], missing_bytes: int, config: Mapping[str, object]
) -> ModelFootprint:
    """A Hub model: the Hub's parameter count, else weight-file bytes / bytes per stored element."""
    kv, context = kv_shape_from_config(config)
    if not param_count:
        weight_bytes = sum(n for f, n in file_sizes.items() if f.endswith((".safetensors", ".bin")))
        stored = dtype_bytes(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), default=2)
        param_count = weight_bytes // stored
    return ModelFootprint(int(param_count), kv, context, download_bytes=missing_bytes)


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --- measuring what the machine has -------------------------------------------------------------------


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo"), cpu_isa: str = "auto") -> bool:
    """Whether the kernels may use AMX here (the CPU reports it and the ISA cap does not hide it), without
    building them: the CPU backend's one AMX decision (engine/backends/cpu_features.amx)."""
    from engine.backends import cpu_features

    return cpu_features.amx(cpu_isa, flags=cpu_features.cpu_flags.__wrapped__(cpuinfo))


def packed_copy_kept(device: str, cpu_kernels: bool, cpu_isa: str = "auto") -> bool:
    """Whether bfloat16 decode steps keep a packed copy of the weights: the CPU backend's answer
    (engine/backends/cpu.py, `keeps_packed_copy`); the one place the preflight, the loader and main.py ask."""
    from engine.backends.cpu import keeps_packed_copy
    from engine.backends.kernels import KernelOptions

    return device == "cpu" and keeps_packed_copy(KernelOptions(cpu_kernels, None, cpu_isa))


def disk_of(path: Path) -> Disk:
    """Free space for a directory that may not exist yet (its nearest existing parent is measured)."""
    probe = path.expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return Disk(str(path), shutil.disk_usage(probe).free, os.stat(probe).st_dev)


def measure_resources(dirs: Iterable[Path], cuda_index: int | None = None) -> Resources:
    """Free RAM (psutil 'available'), free disk for each directory, free VRAM on the CUDA device if any."""
    import psutil

    vram = None
    if cuda_index is not None:
        import torch

        vram, _total = torch.cuda.mem_get_info(cuda_index)
    return Resources(psutil.virtual_memory().available, tuple(disk_of(d) for d in dirs), vram)
