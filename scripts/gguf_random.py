"""A GGUF file's header alone, and a GGUF of random weights rebuilt from such a header: the same metadata, tokenizer,
chat template and tensors (names, shapes, types, offsets), with random values. The weights' values do not change a
step's speed, so a header of a few MB stands in for a file of a GB where only the file's shape matters: a benchmark
on a machine the file cannot be copied to (scripts/bench_isa.py on a lent machine), or a file rebuilt at its real
size from what fits in a repository.

    python scripts/gguf_random.py header model-Q4_K_M.gguf model.header   # the bytes before the tensor data
    python scripts/gguf_random.py fill model.header random-Q4_K_M.gguf     # the header, then random tensors

Values: norms and other one-dimensional tensors 1.0; float matrices normal with deviation 0.02; quantized blocks
random bytes whose float scale fields (QUANT_SCALES) are small positive numbers, so every weight is finite and
near the size a trained model's are. A quantized type without an entry there is refused (its scale fields unknown).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.preflight import gguf_tensor_bytes, read_gguf_layout  # noqa: E402

# Each quantized type's float16 scale fields, as byte offsets inside its block (ggml-common.h's block structs), and
# the value they get: the block's largest weight is about that scale times the largest quant (times the 6-bit
# sub-block scale of the K-quants).
QUANT_SCALES: dict[str, tuple[tuple[int, ...], float]] = {
    "Q4_0": ((0,), 0.003), "Q4_1": ((0, 2), 0.003), "Q5_0": ((0,), 0.0015), "Q5_1": ((0, 2), 0.0015),
    "Q8_0": ((0,), 0.0002), "IQ4_NL": ((0,), 0.0002), "IQ4_XS": ((0,), 0.0002),
    "Q2_K": ((80, 82), 0.0005), "Q3_K": ((108,), 0.0002), "Q4_K": ((0, 2), 0.0002), "Q5_K": ((0, 2), 0.0001),
    "Q6_K": ((208,), 0.00005),
}
FLOATS = {"F32": np.float32, "F16": np.float16}


def write_header(source: Path, out: Path) -> int:
    """`source`'s bytes up to where its tensor data begins, into `out`; their count."""
    start = read_gguf_layout(source).data_start
    with open(source, "rb") as f:
        head = f.read(start)
    out.write_bytes(head)
    return len(head)


def tensor_values(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> bytes:
    """Random bytes of one tensor of ggml type `qtype` and ggml shape `shape` (innermost dimension first)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    count = int(np.prod(shape))
    if qtype in FLOATS or qtype == "BF16":
        values = np.ones(count, np.float32) if len(shape) == 1 else rng.standard_normal(count, np.float32) * 0.02
        if qtype == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return values.astype(FLOATS[qtype]).tobytes()
    if qtype not in QUANT_SCALES:
        raise SystemExit(f"no random values for ggml type {qtype}: its scale fields are not known here")
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = np.frombuffer(rng.bytes(count // block_elems * block_bytes), np.uint8).reshape(-1, block_bytes).copy()
    offsets, scale = QUANT_SCALES[qtype]
    for offset in offsets:
        fields = (scale * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, offset:offset + 2] = fields
    return blocks.tobytes()


def fill(header: Path, out: Path, seed: int = 0) -> int:
    """A GGUF at `out`: `header`'s bytes, then each tensor it describes with random values; the file's size."""
    from gguf import GGMLQuantizationType

    layout = read_gguf_layout(header)
    rng = np.random.default_rng(seed)
    with open(header, "rb") as f:
        head = f.read(layout.data_start)
    if len(head) != layout.data_start:
        raise SystemExit(f"{header} ends at byte {len(head)}, before its tensor data's start ({layout.data_start})")
    with open(out, "wb") as f:
        f.write(head)
        for name in sorted(layout.offsets, key=layout.offsets.__getitem__):
            at = layout.data_start + layout.offsets[name]
            if f.tell() > at:
                raise SystemExit(f"{header}: tensor {name} at byte {at} overlaps the one before it")
            f.write(b"\0" * (at - f.tell()))  # the alignment padding between tensors
            qtype = GGMLQuantizationType(layout.types[name]).name
            data = tensor_values(qtype, layout.shapes[name], rng)
            if len(data) != gguf_tensor_bytes(layout.shapes[name], layout.types[name]):
                raise SystemExit(f"tensor {name}: {len(data)} bytes made, its type and shape say otherwise")
            f.write(data)
        return f.tell()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("header", "fill"))
    p.add_argument("source", type=Path, help="header: a GGUF file; fill: a header written by `header`")
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.step == "header":
        print(f"{args.out}: {write_header(args.source, args.out):,} bytes of header")
    else:
        print(f"{args.out}: {fill(args.source, args.out, args.seed):,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
