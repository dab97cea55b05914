"""A GGUF file served as it is: its quantized tensors stay quantized in RAM (engine/model/quant.py), nothing dense is
written to disk.

What is cached (once, in `<cache>/gguf/<name>-<hash>-quantized/`): config.json, the tokenizer and its chat
template, generation_config.json: a few MB, converted by transformers from the file's metadata. The weights are
read from the file at each start, its header parsed without its vocabulary's arrays (`HeaderReader`; the `gguf`
package's GGUFReader, its array fields read whole (`_reader_class`), reads the metadata for the conversion) and each
tensor read into memory of its own: 2-D quantized matmul
weights (q, k, v, o, gate, up, down, the LM head and the token embedding) become `QuantLinear` /
`QuantEmbedding` over a copy of their raw blocks; 1-D, F32, F16 and BF16 tensors are converted to the serving dtype.
A file with no quantized tensor at all (an F16 or BF16 GGUF: `held_dtype`) is served dense as it is, read the same
way (models/loader.py `load_dense_gguf`): nothing converted to disk, no quantized model to time dense copies against.

llama.cpp's converter permutes the rows of Q and K of Llama models for its RoPE layout; transformers'
GGUF loader un-permutes them (modeling_gguf_pytorch_utils.LlamaTensorProcessor), and so does `unpermute_rows`
here, on whole rows of blocks. A model whose LM head is tied to its embedding keeps one quantized copy. Q4_0 and
Q4_1 rows are rearranged as they are read (`QuantWeight.repack`: the same bytes, laid out for the decode kernels).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import nn

from engine.model.quant import FORMATS, QuantEmbedding, QuantLinear, QuantWeight
from models.fingerprint import gguf_fingerprint
from models.preflight import GgufLayout, gguf_tensor_bytes, read_gguf_layout

log = logging.getLogger(__name__)

META_FORMAT = 4  # bump when the cached metadata layout changes (4: the BOS as llama.cpp adds it)
# GGUF general.architecture values served quantized (the Llama-block families of engine/model/families.py; Mistral
# and Ministral files say "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "granite", "phi3", "gemma2", "gemma3")
PERMUTED = ("llama", "granite")  # llama.cpp's converter permutes Q and K rows of these (its LlamaModel)
DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: converted to the serving dtype
HELD_DTYPES = {30: "bfloat16", 1: "float16", 0: "float32"}  # a dense file's type, the first found in this order
HELD_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
LAYER_NAMES = {  # GGUF blk.N.<name> -> transformers model.layers.N.<name>
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k, v rows in one tensor
}
ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # Phi-3's ffn_up holds the gate rows, then the up rows
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
ARCH_LAYER_NAMES["gemma3"] = ARCH_LAYER_NAMES["gemma2"]  # the same four norms a block
NORM_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp's converter stores Gemma's norm weights as 1 + w; transformers' hold w
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# RoPE frequency factors (Llama 3.x rope scaling; Phi-3's longrope short and long factors): RoPE's inverse
# frequencies are divided by them, as llama.cpp does (`_rebuild_rotary`), not parameters of the model
ROPE_FACTORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
# Architectures served here that transformers' GGUF reader has no table for: their metadata keys (those of "llama",
# plus these) added to its table before it converts the config and tokenizer
EXTRA_METADATA = {"granite": {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                              "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}}


class Unsupported(ValueError):
    """This file cannot be served quantized (an architecture or tensor type the kernels do not take)."""


class BadFile(ValueError):
    """The file is damaged or contradicts itself (truncated, a tensor shape its metadata disagrees with, an
    architecture nothing here knows): no way of serving it will work."""


def hf_name(name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> transformers parameter name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn...")."""
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
        if part in names:
            return f"model.layers.{index}.{names[part]}.{kind}"
    elif stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    raise Unsupported(f"tensor {name} has no place in a Llama-block model")


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation: out[h, j, i] = in[h, i, j], per head [dim/2, 2]."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


# --- the small cached metadata folder ------------------------------------------------------------------


def metadata_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """config.json, tokenizer and generation config of `gguf_path`, converted once (atomic publish)."""

    target = cache_dir / "gguf" / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}-quantized"
    if _ready(target):
        log.info("GGUF %s: using the cached metadata %s (weights stay in the file)", gguf_path.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("GGUF %s: caching its config and tokenizer once in %s (weights stay in the file)", gguf_path.name,
             target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_metadata(gguf_path, tmp)
        if target.exists() and not _ready(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not _ready(target):  # another process published first: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _ready(folder: Path) -> bool:
    try:
        return json.loads((folder / "peregrine.json").read_text()).get("format") == META_FORMAT
    except (OSError, ValueError):
        return False


def _write_metadata(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = gguf_path.parent, gguf_path.name
    teach_transformers()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are loaded here, not by transformers' GGUF quantizer
    _complete(config, gguf_path)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    bos_as_llama_cpp(tokenizer, adds_bos(open_reader(gguf_path)))
    tokenizer.save_pretrained(out)
    marker = {"format": META_FORMAT, "source": str(gguf_path), "weights": "kept quantized in the GGUF file"}
    (out / "peregrine.json").write_text(json.dumps(marker, indent=2) + "\n")


# The BPE pre-tokenizers llama.cpp adds a BOS for when the file does not say (src/llama-vocab.cpp)
BOS_BY_DEFAULT = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "tekken")


def adds_bos(reader: object) -> bool:
    """Whether llama.cpp starts a tokenized prompt with BOS: the file's `tokenizer.ggml.add_bos_token`, else its
    default for the vocabulary: yes for SentencePiece and WordPiece ones and Llama 3's (and a few other) BPE
    pre-tokenizers. transformers' conversion adds none where the key is missing, so a Llama 3 file without it
    lost its <|begin_of_text|> on /v1/completions."""
    fields = reader.fields

    def text(key: str) -> str:
        return str(fields[key].contents()) if key in fields else ""

    if "tokenizer.ggml.add_bos_token" in fields:
        return bool(fields["tokenizer.ggml.add_bos_token"].contents())
    model = text("tokenizer.ggml.model")
    return model in ("llama", "bert", "gemma4") or (model == "gpt2" and text("tokenizer.ggml.pre") in BOS_BY_DEFAULT)


def bos_as_llama_cpp(tokenizer: object, add: bool) -> None:
    """Make `tokenizer.encode` (special tokens on) start with BOS exactly when llama.cpp would (`adds_bos`); chat
    prompts are encoded without special tokens (their templates write the BOS), so only raw prompts change."""
    from tokenizers.processors import TemplateProcessing

    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if bos is None or bos_id is None or (tokenizer.encode("a")[:1] == [bos_id]) == add:
        return
    backend = tokenizer.backend_tokenizer
    if backend.post_processor is not None and not isinstance(backend.post_processor, TemplateProcessing):
        log.warning("tokenizer: a %s post-processor; BOS left as transformers converted it",
                    type(backend.post_processor).__name__)
        return
    first = f"{bos}:0 " if add else ""
    backend.post_processor = TemplateProcessing(single=f"{first}$A:0", pair=f"{first}$A:0 $B:1",
                                                special_tokens=[(bos, bos_id)] if add else [])
    if hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = add


def teach_transformers() -> None:
    """Adds EXTRA_METADATA's architectures to transformers' GGUF tables (once; its own entries are left alone), so
    that its conversion reads their config and tokenizer as it reads the architectures it knows."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for arch, keys in EXTRA_METADATA.items():
        GGUF_CONFIG_MAPPING.setdefault(arch, {**GGUF_CONFIG_MAPPING["llama"], **keys})
        if arch not in reader.GGUF_SUPPORTED_ARCHITECTURES:
            reader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)


def _complete(config: object, gguf_path: Path) -> None:
    """What transformers' GGUF conversion leaves out of the config: the head size (`attention.key_length`, which
    it maps for a few architectures only; Qwen3's default of 128 is wrong for other sizes), Phi-3's share of each
    head that RoPE turns (`rope.dimension_count`), and for Gemma 2 and 3 the attention scale and which layers are
    windowed, as llama.cpp reads them, and Gemma 2's soft caps (the conversion leaves transformers' defaults)."""
    reader = open_reader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.contents())
    rotated = reader.fields.get(f"{arch}.rope.dimension_count")
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "phi3" and rotated is not None and int(rotated.contents()) != head:  # RoPE on part of each head
        factor = int(rotated.contents()) / head
        config.partial_rotary_factor = factor
        if isinstance(getattr(config, "rope_parameters", None), dict) and "rope_type" in config.rope_parameters:
            config.rope_parameters["partial_rotary_factor"] = factor
    if arch in ("gemma2", "gemma3"):  # llama.cpp's attention scale: 1/sqrt(head size); 27B: 1/sqrt(hidden/heads)
        wide = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if wide else config.head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping") if arch == "gemma2" else ():
        if (cap := reader.fields.get(f"{arch}.{key}")) is not None:
            setattr(config, key, float(cap.contents()))
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and getattr(config, "layer_types", None):
        config.layer_types = window_layers(pattern.contents(), config.num_hidden_layers)


def window_layers(pattern: int | list[bool], layers: int) -> list[str]:
    """Which layers attend in a window, as llama.cpp reads `<arch>.attention.sliding_window_pattern`: a flag per
    layer, or n (each n-th layer global, the others windowed; n = 0 or 1 means none windowed). Without the key,
    llama.cpp takes Gemma 3's 6, as transformers' config does."""
    if isinstance(pattern, list):
        windowed = [bool(flag) for flag in pattern]
    else:
        windowed = [int(pattern) > 1 and i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


# --- the model ------------------------------------------------------------------------------------------


def load(gguf_path: Path, folder: Path, dtype: torch.dtype, trust_remote_code: bool = False,
         context: int | None = None) -> nn.Module:
    """The transformers model of `folder`'s config, its weights taken from `gguf_path` (quantized ones kept so).
    `context`: the longest sequence it will serve (default: the model's own context), which picks Phi-3's long or
    short RoPE factors. Raises Unsupported before building anything when the file cannot be served this way,
    BadFile when it is damaged or contradicts its metadata."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = HeaderReader.open(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in ARCHITECTURES:
        raise Unsupported(f"architecture {arch!r} (served quantized: {', '.join(ARCHITECTURES)})")
    odd = [t for t in reader.tensors if int(t.tensor_type) not in (*FORMATS, *DENSE_TYPES)]
    if odd:
        raise Unsupported(unsupported_types(odd))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    tensors = {hf_name(t.name, arch): t for t in reader.tensors if t.name not in ROPE_FACTORS}
    quantized: dict[str, QuantWeight] = {}
    with open(gguf_path, "rb", buffering=0) as file:
        for name, t in sorted(tensors.items(), key=lambda item: item[0].endswith(".bias")):  # weights before biases
            _load_tensor(model, name, _tensor(t, file, dtype, name, config, arch), quantized, dtype)
    _tie_head(model, quantized)
    _rebuild_rotary(model, rope_scaling(reader, arch, context or int(config.max_position_embeddings)))
    leftover = [n for n, p in (*model.named_parameters(), *model.named_buffers()) if p.is_meta]
    if leftover:
        raise Unsupported(f"the file has no values for {', '.join(leftover[:4])}")
    model.eval()
    model.requires_grad_(False)
    return model


def _load_tensor(model: nn.Module, name: str, value: torch.Tensor | QuantWeight, quantized: dict[str, QuantWeight],
                 dtype: torch.dtype) -> None:
    _check_shape(model, name, tuple(value.shape))
    if isinstance(value, QuantWeight):
        quantized[name] = value
        _place_quantized(model, name.removesuffix(".weight"), value, dtype)
    else:
        _set(model, name, nn.Parameter(value, requires_grad=False))


def held_dtype(types: dict[str, int]) -> str | None:
    """The dtype a GGUF holds its weights in when none of its tensors is quantized (`types`: name -> ggml type, as
    preflight.read_gguf_layout gives them): "bfloat16" for a BF16 file, "float16" for an F16 one, "float32"; None
    when any tensor is quantized or of a type the loader does not read."""
    kinds = set(types.values())
    if not kinds or not kinds <= set(DENSE_TYPES):
        return None
    return next(HELD_DTYPES[k] for k in HELD_DTYPES if k in kinds)


def file_held_dtype(path: Path) -> str | None:
    """`held_dtype` of the file at `path`, from its header (OSError, ValueError: unreadable or damaged)."""
    return held_dtype(read_gguf_layout(path).types)


def unsupported_types(tensors: list[object]) -> str:
    """What Unsupported says of tensors whose types the kernels do not take: the first tensor of each such type,
    by name, and how many more there are."""
    first: dict[str, str] = {}
    for t in tensors:
        first.setdefault(t.tensor_type.name, t.name)
    named = ", ".join(f"{name} is {kind}" for kind, name in first.items())
    more = f" (and {len(tensors) - len(first)} more tensors of those types)" if len(tensors) > len(first) else ""
    kernels = ", ".join(f[0] for f in FORMATS.values())
    return f"tensor {named}{more}: the kernels take {kernels}"


def _tensor(t: object, file: BinaryIO, dtype: torch.dtype, name: str, config: object,
            arch: str) -> torch.Tensor | QuantWeight:
    qtype = int(t.tensor_type)
    data = torch.from_numpy(_read(t, file))
    if qtype == 30:  # BF16: numpy has no such type, the reader gives its bytes
        data = data.view(torch.bfloat16)
    if qtype in FORMATS:
        cols, rows = (int(d) for d in t.shape)  # ggml order: the row length first
        value: torch.Tensor | QuantWeight = QuantWeight(data.reshape(rows, -1), qtype, (rows, cols))
    else:
        value = data.reshape(tuple(int(d) for d in reversed(t.shape))).to(dtype)
    if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
        value = value - 1  # transformers' Gemma RMSNorm adds the 1 itself
    heads = _permuted_heads(name, config) if arch in PERMUTED else None
    if heads:
        order = unpermute_rows(value.shape[0], heads)
        if isinstance(value, QuantWeight):
            value = QuantWeight(value.blocks.index_select(0, order).contiguous(), value.qtype, value.shape)
        else:
            value = value.index_select(0, order).contiguous()
    return value.repack() if isinstance(value, QuantWeight) else value  # Q4_0 / Q4_1 / Q8_0 row-packed for the kernels


def _read(t: object, file: BinaryIO) -> np.ndarray:
    """The tensor's values (`t.data`'s dtype and shape) read from the file into memory of their own. Read, not copied
    out of the reader's memory map: the map's pages would count as resident beside the copies until it is closed,
    the file's size twice at the end of the load."""
    out = np.empty(t.data.shape, dtype=t.data.dtype)  # (t.data's shape and dtype: no page of the map is read)
    view = memoryview(out.reshape(-1).view(np.uint8))
    file.seek(int(t.data_offset))
    done = 0
    while done < len(view):
        n = file.readinto(view[done:])
        if not n:
            raise BadFile(f"{t.name} ends past the end of the file")
        done += n
    return out


def _permuted_heads(name: str, config: object) -> int | None:
    if ".self_attn.q_proj." in name:
        return int(config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return int(config.num_key_value_heads or config.num_attention_heads)
    return None


def _place_quantized(model: nn.Module, path: str, weight: QuantWeight, dtype: torch.dtype) -> None:
    parent, _, attr = path.rpartition(".")
    owner = model.get_submodule(parent)
    old = getattr(owner, attr)
    if isinstance(old, nn.Embedding):  # Gemma's scales its rows (scalar_embed_scale): so does the quantized one
        scale = getattr(old, "scalar_embed_scale", None)
        setattr(owner, attr, QuantEmbedding(weight, dtype, None if scale is None else float(scale)))
    else:
        setattr(owner, attr, QuantLinear(weight))


def _set(model: nn.Module, name: str, value: nn.Parameter) -> None:
    path, _, attr = name.rpartition(".")
    owner = model.get_submodule(path)
    if isinstance(owner, QuantLinear) and attr == "bias":
        owner.bias = value
        return
    setattr(owner, attr, value)


def _tie_head(model: nn.Module, quantized: dict[str, QuantWeight]) -> None:
    """No `output.weight` in the file: the LM head is the embedding (one copy, quantized or not)."""
    head = model.lm_head
    if "lm_head.weight" in quantized or isinstance(head, QuantLinear) or not head.weight.is_meta:
        return
    embed = quantized.get("model.embed_tokens.weight")
    if embed is not None:
        model.lm_head = QuantLinear(embed)
    else:
        model.lm_head.weight = model.model.embed_tokens.weight


def rope_scaling(reader: object, arch: str, context: int) -> tuple[list[object], float]:
    """The file's RoPE frequency factors to apply, and the factor cos and sin are multiplied by, as llama.cpp
    applies them: Llama 3.x's `rope_freqs`; Phi-3's longrope (Phi-3.5/4-mini: 128k of context over an original
    4k) `rope_factors_long` when the served context is longer than `rope.scaling.original_context_length`, else
    `rope_factors_short`, and `rope.scaling.attn_factor` (about 1.19 for 128k over 4k) at every length.
    transformers switches Phi-3's factors per forward call by the longest position in it, which would make a
    sequence's RoPE depend on its batch mates; llama.cpp picks once by the context size, and so does this."""
    fields = reader.fields

    def number(key: str) -> float | None:
        field = fields.get(f"{arch}.{key}")
        return None if field is None else float(field.contents())

    factors = [t for t in reader.tensors if t.name in ROPE_FACTORS]
    original = number("rope.scaling.original_context_length")
    long = original is not None and context > original
    factors = [t for t in factors if t.name != ("rope_factors_short.weight" if long else "rope_factors_long.weight")]
    return factors, number("rope.scaling.attn_factor") or 1.0


def _rebuild_rotary(model: nn.Module, scaling: tuple[list[object], float]) -> None:
    """RoPE's inverse frequencies are computed at construction, which ran on the meta device: redo it, then divide
    them by the file's frequency factors and scale cos and sin by its attention factor (`rope_scaling`)."""
    inner = model.model
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return
    factors, attn_factor = scaling
    inner.rotary_emb = rotary = type(rotary)(config=model.config)
    for t in factors:
        factor = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(-1)
        if factor.shape != rotary.inv_freq.shape:
            raise BadFile(f"{t.name} holds {factor.numel()} factors for {rotary.inv_freq.numel()} RoPE frequencies")
        rotary.inv_freq = rotary.inv_freq / factor.to(rotary.inv_freq.dtype)
        rotary.original_inv_freq = rotary.inv_freq
    if attn_factor != 1.0:
        rotary.attention_scaling = attn_factor * getattr(rotary, "attention_scaling", 1.0)


def _check_shape(model: nn.Module, name: str, shape: tuple[int, ...]) -> None:
    """The tensor's shape against the one the metadata (config.json) gives its parameter."""
    path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        raise BadFile(f"tensor {name} has no place in a {model.config.model_type} model") from None
    current = getattr(owner, attr, None)
    if isinstance(owner, QuantLinear) and attr == "bias":
        want: tuple[int, ...] = (owner.out_features,)
    elif isinstance(current, torch.Tensor):
        want = tuple(current.shape)
    else:
        raise BadFile(f"tensor {name} has no place in a {model.config.model_type} model")
    if want != shape:
        raise BadFile(f"tensor {name} is {list(shape)} but the file's metadata makes it {list(want)}")


def open_reader(gguf_path: Path) -> object:
    """The file's GGUFReader (`_reader_class`: its arrays read whole), or BadFile when it cannot be read whole
    (truncated, not a GGUF file)."""
    try:
        reader = _reader_class()(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise BadFile(f"{gguf_path.name} is truncated or not a GGUF file ({exc})") from exc
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    _check_extent(gguf_path, end, "general.architecture" in reader.fields)
    return reader


class _Value:
    """One metadata value, read as GGUFReader's fields are (`contents()`)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def contents(self) -> object:
        return self.value


class HeaderReader:
    """What `load` reads of a GGUF file, from its header (preflight.read_gguf_layout) and a read-only memory map of
    its tensor data: GGUFReader's `fields`, scalars and strings only (arrays are left out), and its `tensors` (the
    gguf package's ReaderTensor, typed and shaped as GGUFReader makes them). GGUFReader first maps every entry of
    the vocabulary's arrays into numpy: tens of seconds for Qwen's 151k tokens and merges, at every load."""

    def __init__(self, gguf_path: Path) -> None:
        layout = read_gguf_layout(gguf_path)
        data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
        self.fields = {key: _Value(value) for key, value in layout.meta.items()}
        self.tensors = [_reader_tensor(name, layout, data) for name in layout.shapes]

    @classmethod
    def open(cls, gguf_path: Path) -> HeaderReader:
        """The file's reader, or BadFile as `open_reader` says it."""
        try:
            reader = cls(gguf_path)
        except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
            raise BadFile(f"{gguf_path.name} is truncated or not a GGUF file ({exc})") from exc
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        _check_extent(gguf_path, end, "general.architecture" in reader.fields)
        return reader


def _reader_tensor(name: str, layout: GgufLayout, data: np.ndarray) -> object:
    """One tensor as GGUFReader gives it: F16 / F32 / F64 and integer tensors as their numpy type in numpy's
    order of dimensions (ggml's reversed), the others as bytes, a row's blocks last."""
    from gguf import GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(layout.types[name])
    dims = np.array(layout.shapes[name], dtype=np.uint64)
    elements = int(np.prod(dims))
    n_bytes = gguf_tensor_bytes(layout.shapes[name], layout.types[name])
    start = layout.data_start + layout.offsets[name]
    shape = tuple(reversed(dims.tolist()))
    item = _NUMPY_TYPES.get(qtype.name)
    if item is None:
        item, shape = np.uint8, quant_shape_to_byte_shape(shape, qtype)
    if start + n_bytes > data.size:
        raise ValueError(f"tensor {name} ends at byte {start + n_bytes}, the file at {data.size}")
    values = data[start:start + n_bytes].view(item).reshape(shape)
    return ReaderTensor(name=name, tensor_type=qtype, shape=dims, n_elements=elements, n_bytes=n_bytes,
                        data_offset=start, data=values, field=None)


_NUMPY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _check_extent(gguf_path: Path, end: int, has_arch: bool) -> None:
    """BadFile when the file's tensors end past the file (`end`: where the last one's bytes end) or it names no
    architecture."""
    if end > gguf_path.stat().st_size:
        raise BadFile(f"{gguf_path.name} is truncated: its tensors end at byte {end}, the file at "
                      f"{gguf_path.stat().st_size}")
    if not has_arch:
        raise BadFile(f"{gguf_path.name} has no general.architecture")


@functools.cache
def _reader_class() -> type:
    """gguf's GGUFReader, with the values of an array field read as one part instead of one numpy array (and a
    recursive call) per element: a 150k-token vocabulary (tokens, merges, types, scores) took that reader 25 s and
    0.5 GB of small objects at each of a start's three reads, and left the heap fragmented. Numeric arrays keep
    their values (`contents()` gives the whole list); string arrays are skipped as one span of bytes (`contents()`
    is []): nothing here reads them (transformers converts the tokenizer with its own reader)."""
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
            if raw_type != GGUFValueType.ARRAY or self.byte_order == "S":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, start = GGUFValueType(int(raw_itype[0])), int(count[0]), orig_offs + 12
            types = [GGUFValueType.ARRAY, itype]
            if (nptype := self.gguf_scalar_to_np.get(itype)) is not None:
                values = self._get(start, nptype, n)
                return 12 + int(values.nbytes), [raw_itype, count, values], [2], types
            if itype != GGUFValueType.STRING:  # arrays of arrays: the reader's own way
                return super()._get_field_parts(orig_offs, raw_type)
            data, end = memoryview(self.data), start
            for _ in range(n):  # each string: its length (u64), then its bytes
                end += 8 + int.from_bytes(data[end : end + 8], "little")
            if end > len(data):
                raise ValueError(f"array at {orig_offs} runs past the end of the file")
            return end - orig_offs, [raw_itype, count, self._get(start, np.uint8, end - start)], [], types

    return Reader


def check(gguf_path: Path) -> str:
    """The file's architecture, once it is known to be readable whole and of an architecture something here serves
    (quantized, or densely through transformers); BadFile otherwise. Run before anything converts it, at each start
    and each load: from the header alone (preflight.read_gguf_layout), not GGUFReader, which maps every token of a
    vocabulary into numpy (tens of seconds for Qwen's 151k tokens and merges)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        layout = read_gguf_layout(gguf_path)
        end = layout.data_end
    except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
        raise BadFile(f"{gguf_path.name} is truncated or not a GGUF file ({exc})") from exc
    _check_extent(gguf_path, end, "general.architecture" in layout.meta)
    arch = str(layout.meta["general.architecture"])
    if arch not in (*ARCHITECTURES, *GGUF_SUPPORTED_ARCHITECTURES):
        raise BadFile(f"{gguf_path.name}: unknown architecture {arch!r} (served quantized: "
                      f"{', '.join(ARCHITECTURES)}; densely: the architectures transformers' GGUF loader reads)")
    return arch


def tensor_bytes(gguf_path: Path) -> int:
    """Bytes of every tensor in the file: the resident size of the weights when served quantized."""
    layout = read_gguf_layout(gguf_path)  # the header alone
    return sum(gguf_tensor_bytes(shape, layout.types[name]) for name, shape in layout.shapes.items())
