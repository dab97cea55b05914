"""Weights kept quantized in RAM: GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) as the
file stores them, and the modules that multiply by them.

- `QuantWeight`: one [N, K] matrix as uint8 rows of blocks (`blocks`, [N, bytes per row]) and its ggml type.
  `matmul(x)` runs Peregrine's kernel (engine/backends/quant_kernels.py), 16 rows at a time: the weights are
  dequantized in L1 and each row's dot products are summed in the same order whatever the number of rows, so a
  prompt's rows get the same bits as decode rows (batch invariance on the op-by-op pass; the one-call step of
  engine/backends/cpu_kernels.py, the default path, multiplies in int8 instead). The kernels are the ones the
  engine's backend chose and handed over (`kernels`, set by engine.backends.cpu.use_quant_kernels at load and
  prepare); None, as with `--cpu-kernels off` or without a compiler: tiles of weight rows dequantized by gguf's
  reference into torch's GEMM. Output in x's dtype; the kernel computes in float32.
- `QuantLinear` / `QuantEmbedding`: drop-in modules for nn.Linear and nn.Embedding (the embedding dequantizes
  only the rows it looks up, so a tied LM head and embedding share one quantized copy).
- `quantize_q8_0`: a dense matrix to Q8_0 blocks (per-32 float16 scale, int8 values), for `--quantize int8`.
- `QuantWeight.repack` / `unpack`: Q4_0, Q4_1 and Q8_0 rows rearranged at load (quant.h: kQ4_0R / kQ4_1R /
  kQ8_0R; as many bytes, the same values): Q4_0 / Q4_1 the nibbles first, 32 bytes per pair of blocks (low
  nibbles: the first block's 32 values in order, high nibbles: the second's), then the row's f16 scales, then its
  f16 minimums; Q8_0 its int8 values first, then its f16 scales. The decode kernels then get 64 weights per load
  and 8 scales per conversion.
- `QuantWeight.tile_` / `tile_weights`: where the CPU build multiplies them 16 rows a lane each (AVX-512 VNNI,
  `Kernels.tile_rows`), the one-call decoder's packed, Q5_0 and K-quant weights are rearranged once more at start,
  in place, each 16 rows interleaved (quant.h: kQ4_0T ... kQ5_0T / kQ4_KT / kQ5_KT / kQ6_KT): the kernel streams a
  tile front to back with no shuffles (the same bits). Their rows are still read one by one where needed
  (`rows_packed`: a tied embedding).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.backends.kernels import linear_torch

# ggml type id -> (name, weights per block, bytes per block)
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
}
Q8_0 = 8
# Peregrine's row-packed Q4_0 / Q4_1 / Q8_0 (ids past ggml's):
# id -> (name, weights per 64-value share of a row, its bytes)
PACKED: dict[int, tuple[str, int, int]] = {1002: ("Q4_0", 64, 36), 1003: ("Q4_1", 64, 40), 1008: ("Q8_0", 64, 68)}
PACKS = {2: 1002, 3: 1003, 8: 1008}  # GGUF type -> its packed form
UNPACKED = {packed: gguf for gguf, packed in PACKS.items()}
# the tiled forms (quant.h: kQ4_0T ...) of the packed ones and of Q5_0, Q4_K, Q5_K and Q6_K: each TILE_ROWS rows
# interleaved for the 16-lane kernels
TILED: dict[int, tuple[str, int, int]] = {2002: ("Q4_0", 64, 36), 2003: ("Q4_1", 64, 40), 2008: ("Q8_0", 64, 68),
                                          2006: ("Q5_0", 32, 22), 2012: ("Q4_K", 256, 144), 2013: ("Q5_K", 256, 176),
                                          2014: ("Q6_K", 256, 210)}
TILES = {1002: 2002, 1003: 2003, 1008: 2008, 6: 2006, 12: 2012, 13: 2013, 14: 2014}  # type -> its tiled form
UNTILED = {tiled: plain for plain, tiled in TILES.items()}
SUPER_TILED = {2006, 2012, 2013, 2014}  # Q5_0's and the K-quants': a block's dwords interleaved (then 16 f16 d)
HEAD_LAST = {2006: 2}  # tiled Q5_0: each block's first 2 bytes (its d) moved last, so its 20 others are 5 dwords
TILE_ROWS = 16
TILE_CHUNK = 4 << 20  # bytes `tile_` rearranges at a time
LAYOUTS = {**FORMATS, **PACKED, **TILED}
log = logging.getLogger(__name__)
PREFILL_TILE_ELEMS = 1 << 22  # float32 weights dequantized at a time for many-row matmuls (16 MiB)


class QuantWeight:
    """A [N, K] weight as rows of quantized blocks. `blocks` may be a view (a slice of a fused weight)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, shape: tuple[int, int], kernels: Any = None) -> None:
        name, per_block, block_bytes = LAYOUTS[qtype]
        rows, cols = shape
        if cols % per_block or tuple(blocks.shape) != (rows, cols // per_block * block_bytes):
            raise ValueError(f"{name} blocks {tuple(blocks.shape)} do not hold a [{rows}, {cols}] matrix")
        if qtype in TILED and (rows % TILE_ROWS or not blocks.is_contiguous()):
            raise ValueError(f"tiled {name} blocks hold whole tiles of {TILE_ROWS} contiguous rows, not {rows}")
        self.blocks, self.qtype, self.shape = blocks, qtype, (rows, cols)
        self.kernels = kernels  # the quantized-weight kernels' module the backend handed over; None: the reference

    @property
    def type_name(self) -> str:
        """The GGUF format's name (a repacked weight keeps its format's)."""
        return LAYOUTS[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] (or the given rows, [len(rows), K])."""
        if self.qtype in TILED:  # the quantized-weight kernels take rows: the packed ones
            packed = self.rows_packed(torch.arange(self.shape[0]) if rows is None else rows.reshape(-1))
            return QuantWeight(packed, UNTILED[self.qtype], (packed.shape[0], self.shape[1]), self.kernels).dequantize()
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows.reshape(-1))
        if self.kernels is not None:
            return self.kernels.dequantize(blocks, self.qtype, self.shape[1])
        from gguf import quants  # no compiler: gguf's numpy reference (slow, exact)

        plain = QuantWeight(blocks, self.qtype, (blocks.shape[0], self.shape[1])).unpack()
        return torch.from_numpy(quants.dequantize(plain.blocks.numpy(), plain.qtype).astype(np.float32, copy=False))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N], in x's dtype (a tiled weight through a packed copy: the one-call decoder
        multiplies those, this is the op-by-op pass's fallback)."""
        if self.qtype in TILED:
            return self.untiled().matmul(x)
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k).to(torch.float32).contiguous()
        kernels = self.kernels
        if kernels is not None and flat.shape[0]:  # any number of rows, max_rows at a time: each row alike
            step = kernels.max_rows
            out = torch.cat([kernels.linear(flat[i : i + step], self.blocks, self.qtype)
                             for i in range(0, flat.shape[0], step)])
        else:
            out = self._matmul_tiles(flat)
        return out.to(x.dtype).reshape(*lead, self.shape[0])

    def _matmul_tiles(self, flat: torch.Tensor) -> torch.Tensor:
        rows, k = self.shape
        step = max(1, PREFILL_TILE_ELEMS // k)
        if step >= rows:
            return linear_torch(flat, self.dequantize())
        out = flat.new_empty(flat.shape[0], rows)
        for start in range(0, rows, step):
            tile = self.slice_rows(start, min(rows, start + step)).dequantize()
            out[:, start : start + step] = linear_torch(flat, tile)
        return out

    def slice_rows(self, start: int, end: int) -> QuantWeight:
        if self.qtype in TILED and start % TILE_ROWS:  # (whole tiles: the constructor checks the row count)
            raise ValueError(f"a slice of a tiled weight starts on a tile of {TILE_ROWS} rows, not at row {start}")
        return QuantWeight(self.blocks[start:end], self.qtype, (end - start, self.shape[1]), self.kernels)

    def _split(self) -> tuple[int, int]:
        """A packed or tiled row's bytes of values and of scale halves (Q8_0: K and K / 16; Q4: K / 2 and K / 16 or
        K / 8)."""
        values = self.shape[1] if LAYOUTS[self.qtype][0] == "Q8_0" else self.shape[1] // 2
        return values, self.blocks.shape[1] - values

    def tile_(self) -> None:
        """A packed (or Q5_0, Q4_K, Q6_K) weight's bytes rearranged in place into its tiled form (quant.h: kQ4_0T ...):
        each TILE_ROWS rows (a multiple of them) their values, 32-byte chunk by chunk, as 8 dwords of each row in turn,
        then their scale halves, half by half, each row's in turn (Q4_K: each super-block's 36 dwords, each row's in
        turn; Q6_K: its first 52 dwords so, then each row's f16 d; Q5_0: each block's last 5 dwords, then d). Its
        type becomes the tiled one; other QuantWeights on these bytes must change theirs too (`tile_weights`). Tiles
        are independent, so they are rearranged `TILE_CHUNK` bytes at a time: the start never holds a second copy of a
        weight (Gemma's 626 MB embedding)."""
        step = max(1, TILE_CHUNK // (TILE_ROWS * self.blocks.shape[1])) * TILE_ROWS
        split = None if TILES[self.qtype] in SUPER_TILED else self._split()
        for start in range(0, self.blocks.shape[0], step):
            _tile(self.blocks[start : start + step], LAYOUTS[self.qtype][2], split, HEAD_LAST.get(TILES[self.qtype], 0))
        self.qtype = TILES[self.qtype]

    def rows_packed(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed (Q5_0, Q4_K, Q6_K: the file's) bytes [len(rows), ldw] of the given rows of a tiled weight (`tile_`
        undone for them)."""
        tile, lane = rows // TILE_ROWS, rows % TILE_ROWS
        flat = self.blocks.view(-1, TILE_ROWS * self.blocks.shape[1])
        if self.qtype in SUPER_TILED:
            size, head = LAYOUTS[self.qtype][2], HEAD_LAST.get(self.qtype, 0)
            dwords, blocks = size // 4 * 4, self.blocks.shape[1] // size
            per_block = flat.reshape(flat.shape[0], blocks, TILE_ROWS * size)
            d = per_block[..., : TILE_ROWS * dwords].reshape(-1, blocks, dwords // 4, TILE_ROWS, 4)[tile, :, :, lane]
            r = per_block[..., TILE_ROWS * dwords :].reshape(flat.shape[0], blocks, TILE_ROWS, size - dwords)
            r = r[tile, :, lane]
            return torch.cat([d.reshape(len(rows), blocks, dwords), r], 2).roll(head, -1).reshape(len(rows), -1)
        values, scales = self._split()
        v = flat[:, : TILE_ROWS * values].reshape(-1, values // 32, 8, TILE_ROWS, 4)[tile, :, :, lane]
        s = flat[:, TILE_ROWS * values :].reshape(-1, scales // 2, TILE_ROWS, 2)[tile, :, lane]
        return torch.cat([v.reshape(len(rows), values), s.reshape(len(rows), scales)], 1)

    def untiled(self) -> QuantWeight:
        """A packed copy of a tiled weight (itself when not tiled)."""
        if self.qtype not in TILED:
            return self
        return QuantWeight(self.rows_packed(torch.arange(self.shape[0])), UNTILED[self.qtype], self.shape, self.kernels)

    def repack(self) -> QuantWeight:
        """Q4_0 / Q4_1 / Q8_0 rows packed for the decode kernels (module docstring, quant.h: kQ4_0R / kQ4_1R /
        kQ8_0R); other formats, and rows whose length is not a multiple of 64, as they are. As many bytes, the same
        values."""
        packed_type = PACKS.get(self.qtype)
        rows, cols = self.shape
        if packed_type is None or cols % 64:
            return self
        if self.qtype == Q8_0:  # the values, then the scales
            b = self.blocks.reshape(rows, cols // 32, 34)
            values = b[..., 2:].reshape(rows, cols)
            return QuantWeight(torch.cat([values, b[..., :2].reshape(rows, -1)], dim=1), packed_type, self.shape,
                               self.kernels)
        head = 2 if self.qtype == 2 else 4  # d, or d and m (f16 each)
        b = self.blocks.reshape(rows, cols // 32, 16 + head)
        nibbles = b[..., head:].reshape(rows, cols // 64, 2, 16)
        values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)  # [rows, pairs, 2, 32]: each group's values in order
        packed = (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(rows, cols // 2)
        scales = b[..., :head].reshape(rows, cols // 32, head // 2, 2).transpose(1, 2).reshape(rows, -1)  # d..., m...
        return QuantWeight(torch.cat([packed, scales], dim=1), packed_type, self.shape, self.kernels)

    def unpack(self) -> QuantWeight:
        """The GGUF blocks of a packed or tiled weight (`repack` undone); any other weight as it is."""
        if self.qtype in TILED:
            return self.untiled().unpack()
        gguf = UNPACKED.get(self.qtype)
        if gguf is None:
            return self
        rows, cols = self.shape
        if gguf == Q8_0:
            values = self.blocks[:, :cols].reshape(rows, cols // 32, 32)
            scales = self.blocks[:, cols:].reshape(rows, cols // 32, 2)
            return QuantWeight(torch.cat([scales, values], dim=-1).reshape(rows, -1), gguf, self.shape, self.kernels)
        head = 2 if gguf == 2 else 4
        packed = self.blocks[:, : cols // 2].reshape(rows, cols // 64, 32)
        values = torch.stack([packed & 0xF, packed >> 4], dim=2)  # [rows, pairs, 2, 32]
        nibbles = (values[..., :16] | (values[..., 16:] << 4)).reshape(rows, cols // 32, 16)
        scales = self.blocks[:, cols // 2 :].reshape(rows, head // 2, cols // 32, 2).transpose(1, 2)
        blocks = torch.cat([scales.reshape(rows, cols // 32, head), nibbles], dim=-1)
        return QuantWeight(blocks.reshape(rows, -1), gguf, self.shape, self.kernels)


def concat(weights: list[QuantWeight]) -> QuantWeight | None:
    """One weight of the rows of all (same type and K), or None when they differ (then they stay apart)."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.shape[1] != first.shape[1] for w in weights):
        return None
    blocks = stack_rows([w.blocks for w in weights])
    return QuantWeight(blocks, first.qtype, (sum(w.shape[0] for w in weights), first.shape[1]), first.kernels)


def _tile(blocks: torch.Tensor, size: int, split: tuple[int, int] | None, head: int = 0) -> None:
    """`QuantWeight.tile_` on whole tiles of rows (`blocks`, contiguous, in place); `split`: a packed row's bytes of
    values and of scale halves, None for Q5_0 and the K-quants (`size`: a block's bytes, its first `head` last)."""
    rows, ldw = blocks.shape
    tiles = blocks.reshape(rows // TILE_ROWS, TILE_ROWS, ldw)
    if split is None:  # each block's dwords (dword i of row j at 64 i + 4 j), then the 16 rows' remaining 2 bytes
        dwords, rest, per_row = size // 4 * 4, size % 4, ldw // size  # (Q6_K's d, Q5_0's) in turn
        per_block = tiles.reshape(-1, TILE_ROWS, per_row, size).roll(-head, -1)
        d = per_block[..., :dwords].reshape(-1, TILE_ROWS, per_row, dwords // 4, 4).permute(0, 2, 3, 1, 4)
        r = per_block[..., dwords:].permute(0, 2, 1, 3)
        tiled = rows // TILE_ROWS, per_row
        blocks.copy_(torch.cat([d.reshape(*tiled, TILE_ROWS * dwords), r.reshape(*tiled, TILE_ROWS * rest)], 2)
                     .view(rows, ldw))
        return
    values, scales = split
    v = tiles[..., :values].reshape(-1, TILE_ROWS, values // 32, 8, 4).permute(0, 2, 3, 1, 4)
    s = tiles[..., values:].reshape(-1, TILE_ROWS, scales // 2, 2).permute(0, 2, 1, 3)
    blocks.copy_(torch.cat([v.reshape(-1, TILE_ROWS * values), s.reshape(-1, TILE_ROWS * scales)], 1).view(rows, ldw))


def lay_out(weights: list[Any], model: nn.Module, tiled: bool) -> int:
    """The packed, Q5_0, Q4_K and Q6_K weights among `weights` (a forward's matmuls) tiled in place (`tile_weights`) if
    the first forward over `model` asks for it, noted on the model (`is_tiled`). Later forwards, of any kind, run on
    that layout (every CPU build multiplies tiled weights; those without the 16-lane loops gather a tile's rows back
    first), so bytes that engines share never change under one of them. Returns the bytes tiled."""
    if hasattr(model, "peregrine_tiled"):
        return 0
    model.peregrine_tiled = tiled
    if not tiled:
        return 0
    done = tile_weights(weights, model)
    if done:
        log.info("decode-step weights tiled for the 16-lane kernels: %.1f MiB", done / 2**20)
    return done


def is_tiled(model: nn.Module) -> bool:
    """Whether `lay_out` tiled this model's weights."""
    return bool(getattr(model, "peregrine_tiled", False))


def tile_weights(weights: list[Any], model: nn.Module) -> int:
    """Tile each packed weight of `weights` (matmul weights: dense, quantized, lists of pieces) in place
    (`QuantWeight.tile_`) where it is whole tiles of contiguous rows and every QuantWeight of `model` on its bytes (a
    fused weight's slices, a tied embedding) lies on whole tiles of it: those all take the tiled type. Returns the
    bytes tiled."""
    weights = _quantized(weights)
    holders = [*weights, *(m.qweight for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding))]
    done = 0
    for weight in weights:
        if _tileable(weight.qtype, weight.blocks, holders):
            weight.tile_()
            for h in holders:
                if _overlap(h.blocks, weight.blocks):
                    h.qtype = weight.qtype
            done += weight.nbytes
    return done


def _tileable(qtype: int, blocks: torch.Tensor, holders: list[QuantWeight]) -> bool:
    """Whether a weight of `qtype` in rows on `blocks` may be tiled: a form with a tiled one, whole tiles of contiguous
    rows, and every holder on its bytes on whole tiles of it."""
    pairs = TILES.get(qtype) != 2006 or blocks.shape[1] // LAYOUTS[qtype][2] % 2 == 0  # Q5_0's loop: pairs of groups
    if qtype not in TILES or blocks.shape[0] % TILE_ROWS or not blocks.is_contiguous() or not pairs:
        return False
    tile_bytes = TILE_ROWS * blocks.stride(0)
    return all(_on_tiles(h.blocks, blocks, tile_bytes) for h in holders if _overlap(h.blocks, blocks))


def _quantized(weights: list[Any]) -> list[QuantWeight]:
    """The QuantWeights of a list of weights (a list among them: its pieces)."""
    return [p for w in weights for p in (w if isinstance(w, list) else [w]) if isinstance(p, QuantWeight)]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 tensors share bytes (one storage, overlapping spans: after huge_pages.gather every weight
    lies in one storage)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return a.storage_offset() < b.storage_offset() + b.numel() and b.storage_offset() < a.storage_offset() + a.numel()


def _on_tiles(view: torch.Tensor, whole: torch.Tensor, tile_bytes: int) -> bool:
    """Whether the uint8 rows `view` are whole tiles of `whole` (of `tile_bytes` each), on the same storage."""
    offset = view.storage_offset() - whole.storage_offset()
    return (view.is_contiguous() and view.stride(0) == whole.stride(0) and offset >= 0 and offset % tile_bytes == 0
            and view.numel() % tile_bytes == 0 and offset + view.numel() <= whole.numel())


def stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of 2-D row blocks, or, where they already lie back to back in one storage (fused before, by an
    earlier forward over the same model), a tensor over those rows: no second copy."""
    first = parts[0]
    offset, adjacent = first.storage_offset(), True
    for p in parts:
        adjacent &= (p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and p.is_contiguous()
                     and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] and p.storage_offset() == offset)
        offset += p.numel()
    if not adjacent or first.dim() != 2:
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]),
                                   first.stride())


class QuantLinear(nn.Module):
    """nn.Linear over a QuantWeight (the blocks are a buffer, so they move and count with the model)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.qweight.matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        packed = " (row-packed)" if self.qweight.qtype in PACKED else " (tiled)" if self.qweight.qtype in TILED else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qweight.type_name}{packed}"


class QuantEmbedding(nn.Module):
    """nn.Embedding over a QuantWeight: a lookup dequantizes the rows it needs (times `scale`, rounded to the dtype
    first, where the embedding it replaces scaled its rows: Gemma's sqrt(hidden))."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, scale: float | None = None) -> None:
        super().__init__()
        self.qweight, self.dtype, self.scale = weight, dtype, scale
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.dequantize(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=self.dtype)


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """Dense [N, K] (K a multiple of 32) -> Q8_0 blocks: per 32 values a float16 scale d = max|w| / 127 and
    int8 round(w / d), ggml's own rounding."""
    rows, cols = weight.shape
    groups = weight.detach().to(torch.float32).reshape(rows, cols // 32, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(groups * inverse).clamp(-127, 127).to(torch.int8)
    d = scale.to(torch.float16).view(torch.uint8).reshape(rows, cols // 32, 2)
    blocks = torch.cat([d, q.view(torch.uint8)], dim=-1).reshape(rows, cols // 32 * 34)
    return QuantWeight(blocks.contiguous(), Q8_0, (rows, cols))


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in RAM: parameters and buffers (quantized blocks counted once)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())
