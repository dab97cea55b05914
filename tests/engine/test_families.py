"""The model families served quantized on the fast path (engine/model/families.py): for each, a tiny random-weight
model written as a GGUF file the way llama.cpp's converter lays it out (tests/family_gguf.py: Q8_0 matmul weights),
loaded through models/gguf_weights.py and served by the engine, where every step (prefill and decode) goes through
the C++ one-call decoder; the reference is transformers' own model of the same family on the dequantized weights.
Gemma 3's tiny model has a window of 4 on its first layer (its own RoPE base) and a global second layer, so the
window and both RoPE tables matter within the 24 positions of a test; Gemma 2's has the same window and soft caps
low enough to bind (attention 0.5, logits 50; without them its logits move 5% and 176%).

Stated bound: the decoder multiplies int8-quantized activations (blocks of 32, as llama.cpp does) by the Q8_0
weights, so its logits differ from the float32 reference by the activations' rounding: at prefill and at each of 16
decode steps, at most 3% of the reference's largest logit (measured, AMD EPYC Zen 3, AVX2: llama3 0.60%, mistral
1.12%, qwen3 1.13%, granite 0.18%, phi3 1.22%, phi3-long 1.16% past its original context, gemma3 0.20%; gemma2 0.59%
on AMD EPYC Zen 4, avx512_bf16; tests/engine/test_qdot.py holds the Llama decoder to 5%), and the 16
greedy tokens equal transformers' generate. A prompt gives the same tokens and logprobs, to the bit, alone and with
batch mates. In bfloat16, the decoder against the op-by-op pass over the same quantized weights (float activations):
within 5% of the largest logit at each decode step (measured 0.2-1.7%), bitwise the same alone and in a batch.
A bare .gguf of each family converts (transformers' GGUF reader, taught Granite's keys) to a config of that
family served on the fast path. Damaged files get one clear error before anything is built."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.model.families import FAMILIES, block_of, family_of
from engine.model.forward import supports
from engine.model.quant import QuantLinear
from engine.types import EngineConfig, SamplingParams
from models import gguf_weights
from models.loader import LoadError, load_model
from tests.family_gguf import PHI3_LONGROPE, SPECS, write_family
from tests.support import Loaded, decoder_against_op_by_op, make_engine, run_all, tokens_of

pytestmark = pytest.mark.timeout(900)
BOUND = 0.03  # logits: max |ours - reference| / max |reference|
PROMPT = [5, 60, 61, 62, 63, 64, 200, 17]
MATES = {"b": [9, 8, 7, 6, 5, 4, 3, 2, 1, 300], "c": [40, 41]}
STEPS = 16


def vocab_of(tokenizer: object) -> int:
    n = len(tokenizer)
    return n + (-n) % 32  # Q8_0 rows of the LM head


@pytest.fixture(scope="module", params=list(SPECS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           byte_level_tokenizer: object) -> tuple[str, torch.nn.Module, Loaded]:
    """(family, the float32 reference, the GGUF file served quantized)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = write_family(folder, request.param, vocab_of(byte_level_tokenizer))
    context = SPECS[request.param].context
    model = gguf_weights.load(folder / "tiny.gguf", folder, torch.float32, context=context)
    return request.param, reference, Loaded(model, byte_level_tokenizer, context or 256)


def greedy(logprobs: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=logprobs or None)


def test_every_family_is_in_the_table() -> None:
    assert {"llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma2", "gemma3_text"} <= set(FAMILIES)
    assert set(gguf_weights.ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "granite", "phi3", "gemma2", "gemma3"}


def test_logits_and_greedy_match_transformers_on_the_fast_path(served: tuple[str, torch.nn.Module, Loaded]) -> None:
    family, reference, loaded = served
    assert family_of(loaded.model.config) is not None
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    error, ours, theirs = against_transformers(make_engine(loaded), reference, PROMPT)
    assert error <= BOUND, f"{family}: logit error {error:.3g} of the largest logit"
    assert ours == theirs, family


def against_transformers(engine: object, reference: torch.nn.Module, prompt: list[int],
                         impl: str = "llama") -> tuple[float, list[int], list[int]]:
    """The engine's greedy run of `prompt` on the fast path (or `impl`) against transformers': the largest logit
    error (of the reference's largest logit) at prefill and each decode step, and both runs' tokens."""
    assert engine.runner.impl == impl
    fast, captured = engine.runner.forward, []

    def spy(*args: object) -> torch.Tensor:
        logits = fast(*args)
        captured.append(logits.float().clone())
        return logits

    engine.runner._forward = spy
    ours = tokens_of(run_all(engine, {"a": (prompt, greedy())})["a"])
    assert impl != "llama" or fast._decoder is not None, "the one-call C++ decoder did not run"
    with torch.inference_mode():
        want = reference(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got = torch.cat(captured)
    assert got.shape == want.shape == (STEPS, want.shape[1])
    return float((got - want).abs().max() / want.abs().max()), ours, theirs


def test_batch_invariant(served: tuple[str, torch.nn.Module, Loaded]) -> None:
    family, _, loaded = served
    alone = run_all(make_engine(loaded), {"a": (PROMPT, greedy(1))})["a"]
    mates = {name: (prompt, greedy(1)) for name, prompt in MATES.items()}
    together = run_all(make_engine(loaded), {"a": (PROMPT, greedy(1)), **mates})["a"]
    assert tokens_of(alone) == tokens_of(together), family
    lp = [[p.logprob for o in outs for p in o.logprobs] for outs in (alone, together)]
    assert len(lp[0]) == STEPS and lp[0] == lp[1], family


def test_gemma2_soft_caps_bind_and_both_paths_apply_them(served: tuple[str, torch.nn.Module, Loaded]) -> None:
    """Gemma 2's tiny model caps its attention scores at 0.5 and its logits at 50: without either cap the reference's
    logits move by more than BOUND (so the fast path's match above holds both), and the generic path (transformers'
    own Gemma 2 modules over the paged attention, which gets the cap as `softcap`) matches too."""
    family, reference, loaded = served
    if family != "gemma2":
        pytest.skip("Gemma 2 only")
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        capped = reference(ids).logits[0]
        attention = [layer.self_attn for layer in reference.model.layers]
        for a in attention:
            a.attn_logit_softcapping = None
        try:
            scores_only = reference(ids).logits[0]
            reference.config.final_logit_softcapping = None
            neither = reference(ids).logits[0]
        finally:
            reference.config.final_logit_softcapping = 50.0
            for a in attention:
                a.attn_logit_softcapping = 0.5
    moved = [float((uncapped - capped).abs().max() / capped.abs().max()) for uncapped in (scores_only, neither)]
    assert moved[0] > BOUND and moved[1] > 10 * BOUND, moved  # measured 5.1% and 176%
    error, ours, theirs = against_transformers(make_engine(loaded, model_impl="generic"), reference, PROMPT, "generic")
    assert error <= BOUND, f"generic path: logit error {error:.3g} of the largest logit"
    assert ours == theirs


def test_llama3_rope_freqs_reach_the_rotary_module(served: tuple[str, torch.nn.Module, Loaded]) -> None:
    """Llama 3.x files carry their rope scaling as rope_freqs (config.json has none): the served model's inverse
    frequencies are the scaled ones, which the fast path's RoPE tables come from."""
    family, reference, loaded = served
    if family != "llama3":
        pytest.skip("Llama 3.x only")
    ours, theirs = loaded.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq
    assert loaded.model.config.rope_parameters["rope_type"] == "default"  # as transformers converts such a file
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 32, 2) / 32)
    assert not torch.allclose(ours, plain)  # the scaling changes some of them


def test_phi3_long_factors_past_the_original_context(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """Phi-3.5/4-mini files hold longrope's short and long factors and an attention factor (about 1.19 for 128k over
    4k). Served with a context past the original one, the long factors apply from the first position (llama.cpp's
    rule: picked once by the context, so a sequence's RoPE never depends on its batch mates); within it, the short
    ones (the `served` fixture's phi3-long). Against transformers, which picks the long factors for a forward call
    longer than the original context: a prompt of 80 > 64 tokens, its prefill and 16 decode steps."""
    reference = write_family(tmp_path, "phi3-long", vocab_of(byte_level_tokenizer))
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32, context=256)
    rotary = model.model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(1.1547, abs=1e-4)  # sqrt(1 + ln(256 / 64) / ln 64)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 24, 2) / 24)
    torch.testing.assert_close(rotary.inv_freq, plain / torch.tensor(PHI3_LONGROPE["long_factor"]), rtol=1e-6, atol=0)
    short = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32, context=64).model.rotary_emb
    torch.testing.assert_close(short.inv_freq, plain / torch.tensor(PHI3_LONGROPE["short_factor"]), rtol=1e-6, atol=0)
    assert short.attention_scaling == rotary.attention_scaling  # at every length, as llama.cpp and transformers do
    prompt = [(7 * i + 3) % 250 + 2 for i in range(80)]
    error, ours, theirs = against_transformers(make_engine(Loaded(model, byte_level_tokenizer, 256)), reference, prompt)
    torch.testing.assert_close(reference.model.rotary_emb.inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)  # its long ones
    assert error <= BOUND, f"logit error {error:.3g} of the largest logit"
    assert ours == theirs


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("family", list(SPECS))
def test_bfloat16_decoder_against_op_by_op(family: str, kv: str, tmp_path: Path, byte_level_tokenizer: object) -> None:
    """`kv` int8 (`--kv-cache-dtype int8`, on every family: Gemma's windowed layer and soft caps, Qwen3's q/k norms,
    Phi's fused tensors): the decoder's int8 keys and values against the op-by-op pass over the same int8 cache (its
    dequantized blocks), within the same bound (measured 0.2-1.8%, AMD EPYC Zen 4, avx512_bf16)."""
    write_family(tmp_path, family, vocab_of(byte_level_tokenizer))
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.bfloat16)
    engine = make_engine(Loaded(model, byte_level_tokenizer, 256), model_impl="llama", kv_cache_dtype=kv)
    assert engine.kv_cache.quantized == (kv == "int8")
    requests = {"a": (PROMPT, greedy()), "b": (MATES["b"], greedy())}
    fast = engine.runner._forward
    steps = decoder_against_op_by_op(engine, engine.runner.forward._decoder_factory, requests, follow="reference")
    assert type(fast._decoder[1]).__name__ == f"LlamaDecoder_bfloat16{'_kv_int8' if kv == 'int8' else ''}"
    assert len(steps) == STEPS - 1
    assert max(step.error for step in steps) <= 5e-2, [round(step.error, 4) for step in steps]
    assert all(step.batch_invariant for step in steps)


def test_int8_kv_cache_prompt_rows_past_a_whole_chunk_behind_their_window(
        served: tuple[str, torch.nn.Module, Loaded]) -> None:
    """A windowed layer's prompt rows attend to the chunks of 64 positions their window reaches; with an int8 cache
    a chunk's rows are widened once for all the prompt rows of an item, and a chunk lying wholly behind an item's
    windows has none to widen (that case aborted the process before: a negative count). A 120-token prompt and a
    short one in one prefill step through the decoder, against the op-by-op pass over the same int8 cache: the same
    greedy tokens, and logits within BOUND at the prefill and every decode step (measured, AMD EPYC Zen 4,
    avx512_bf16: gemma2 0.54%, gemma3 0.25%)."""
    family, _, loaded = served
    if not getattr(loaded.model.config, "sliding_window", None):
        pytest.skip("no windowed layer")
    prompt = [(7 * i + 3) % 250 + 2 for i in range(120)]
    requests = {"a": (prompt, greedy()), "b": (MATES["b"], greedy())}
    tokens, logits = [], []
    for more in ({}, {"cpu_kernels": False}):
        engine = make_engine(loaded, kv_cache_dtype="int8", max_num_batched_tokens=256, **more)
        forward, captured = engine.runner.forward, []

        def spy(*args: object, forward: object = forward, captured: list = captured) -> torch.Tensor:
            captured.append(forward(*args).float().clone())
            return captured[-1]

        engine.runner._forward = spy
        outs = run_all(engine, requests)
        assert (forward._decoder is not None) == (not more), "the decoder ran where it should, and only there"
        tokens.append({r: tokens_of(outs[r]) for r in requests})
        logits.append(torch.cat(captured))
    assert tokens[0] == tokens[1], family
    ours, reference = logits
    assert ours.shape == reference.shape and ours.shape[0] == 2 * STEPS
    error = float((ours - reference).abs().max() / reference.abs().max())
    assert error <= BOUND, f"{family}: logit error {error:.3g} of the largest logit"


@pytest.mark.parametrize("family", list(SPECS))
def test_a_bare_gguf_converts_to_its_family(family: str, tmp_path: Path, byte_level_tokenizer: object) -> None:
    """Only the .gguf (its metadata as llama.cpp writes it): the cached config and tokenizer are transformers'
    conversion, with Granite's multipliers and Qwen3's head size, and the model is served on the fast path."""
    from transformers import AutoTokenizer

    files = tmp_path / "file"
    files.mkdir()
    write_family(files, family, vocab_of(byte_level_tokenizer), tokenizer=byte_level_tokenizer)
    (files / "config.json").unlink()
    folder = gguf_weights.metadata_folder(files / "tiny.gguf", tmp_path / "cache")
    model = gguf_weights.load(files / "tiny.gguf", folder, torch.float32)
    spec, config = SPECS[family], model.config
    assert config.model_type == (spec.served_type or spec.model_type) and block_of(config).head_dim == 32
    if family == "granite":
        multipliers = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        assert [getattr(config, k) for k in multipliers] == [spec.extra[k] for k in multipliers]
    assert supports(model)
    if family.startswith("gemma"):  # as llama.cpp reads the file: the window, which layers have it, the scale
        assert (config.sliding_window, config.layer_types) == (4, ["sliding_attention", "full_attention"])
        assert config.query_pre_attn_scalar == 32
    if family == "gemma2":  # the file's soft caps, not transformers' defaults (50, 30)
        caps = (config.attn_logit_softcapping, config.final_logit_softcapping)
        assert caps == (spec.extra["attn_logit_softcapping"], spec.extra["final_logit_softcapping"]) == (0.5, 50.0)
        assert (block_of(config).attn_softcap, block_of(config).final_softcap) == caps
    if family == "phi3":  # RoPE on 24 of each head's 32 dimensions (the file's rope.dimension_count)
        assert config.partial_rotary_factor == config.rope_parameters["partial_rotary_factor"] == 0.75
    if family.startswith("gemma"):  # transformers rebuilds Gemma's tokenizer as SentencePiece, which this BPE is not
        return
    text = "def add(a, b): return a + b"
    assert AutoTokenizer.from_pretrained(folder).encode(text) == byte_level_tokenizer.encode(text)


# --- files that cannot be served -----------------------------------------------------------------------


def write_unknown(path: Path) -> None:
    writer = gguf.GGUFWriter(path, "nosucharch")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()


def test_truncated_file_is_one_clear_error(tmp_path: Path, byte_level_tokenizer: object) -> None:
    write_family(tmp_path, "qwen3", vocab_of(byte_level_tokenizer))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(gguf_weights.BadFile, match="truncated"):
        gguf_weights.check(path)
    cfg = EngineConfig(model_path=str(tmp_path), model_name="t", gguf_file=path.name, device="cpu", dtype="float32",
                       weight_format="quantized", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(LoadError, match="truncated") as caught:
        load_model(cfg)
    assert "\n" not in str(caught.value)


def test_the_header_reader_reads_what_gguf_reader_reads(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """`load` reads the header and maps the tensor data (gguf_weights.HeaderReader), not GGUFReader, which maps each
    entry of a vocabulary's arrays into numpy first: the same tensors (name, type, shape, offset, bytes, numpy type
    and shape of the data) and the same scalar and string metadata; arrays are left out. A family file with a
    tokenizer, and one of F16, Q4_1 and integer tensors."""
    write_family(tmp_path, "gemma3", vocab_of(byte_level_tokenizer), tokenizer=byte_level_tokenizer,
                 chat_template="{{ messages }}")
    writer = gguf.GGUFWriter(tmp_path / "types.gguf", "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float16).reshape(2, 32))
    blocks = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("positions", np.arange(5, dtype=np.int32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    for path in (tmp_path / "tiny.gguf", tmp_path / "types.gguf"):
        ours, theirs = gguf_weights.HeaderReader.open(path), gguf.GGUFReader(path)
        scalars = {k: f.contents() for k, f in theirs.fields.items()
                   if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
        assert {k: f.contents() for k, f in ours.fields.items()} == scalars
        assert "tokenizer.ggml.tokens" in theirs.fields or path.name == "types.gguf"

        def described(reader: object) -> list[tuple]:
            return [(t.name, int(t.tensor_type), list(t.shape), t.n_elements, t.n_bytes, t.data_offset, t.data.dtype,
                     t.data.shape, t.data.tobytes()) for t in reader.tensors]

        assert described(ours) == described(theirs)


def test_unknown_architecture_is_one_clear_error(tmp_path: Path) -> None:
    write_unknown(tmp_path / "odd.gguf")
    with pytest.raises(gguf_weights.BadFile, match="unknown architecture 'nosucharch'"):
        gguf_weights.check(tmp_path / "odd.gguf")


def test_shape_against_metadata_is_one_clear_error(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """config.json (the file's metadata, converted) says a feed-forward width the tensors do not have."""
    from transformers import AutoConfig

    write_family(tmp_path, "qwen3", vocab_of(byte_level_tokenizer))
    config = AutoConfig.from_pretrained(tmp_path)
    config.intermediate_size = 192
    config.save_pretrained(tmp_path)
    with pytest.raises(gguf_weights.BadFile, match=r"ffn|mlp.*\[256, 128\].*\[192, 128\]"):
        gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)


def test_acquire_stops_at_start_with_the_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `main` logs and exits 1 on (its StartError): before any preflight, conversion or kernel."""
    from config import load_settings
    from models.acquire import StartError, acquire

    write_unknown(tmp_path / "odd.gguf")
    monkeypatch.chdir(tmp_path)  # no .env
    settings = load_settings(["--model", str(tmp_path / "odd.gguf"), "--device", "cpu", "--embedding-model", "none",
                              "--cache-dir", str(tmp_path)])
    with pytest.raises(StartError, match="unknown architecture 'nosucharch'") as caught:
        acquire(settings)
    assert "\n" not in str(caught.value)


def test_the_window_pattern_as_llama_cpp_reads_it() -> None:
    s, f = "sliding_attention", "full_attention"
    assert gguf_weights.window_layers(6, 7) == [s, s, s, s, s, f, s]  # Gemma 3's: each 6th layer global
    assert gguf_weights.window_layers(2, 3) == [s, f, s]
    assert gguf_weights.window_layers(1, 2) == gguf_weights.window_layers(0, 2) == [f, f]
    assert gguf_weights.window_layers([True, False, False], 3) == [s, f, f]
