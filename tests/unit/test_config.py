"""Settings: sources and their priority, validation with clean one-line errors, --help, frozen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from config import ConfigError, Settings, load_settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No PEREGRINE_* / HF_TOKEN / RAY_ADDRESS from the caller, and a working directory without .env."""
    import os

    for name in list(os.environ):
        if name.startswith("PEREGRINE_") or name in ("HF_TOKEN", "RAY_ADDRESS"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_defaults() -> None:
    s = load_settings([])
    assert s.model == "bundled:smollm2"
    assert (s.host, s.port, s.device, s.dtype) == ("127.0.0.1", 8000, "auto", "auto")
    assert s.embedding_model == "bundled:all-minilm-l6-v2"
    assert s.hf_token is None and s.kv_cache_bytes is None and s.max_model_len is None
    assert s.kv_cache_dtype == "auto" and load_settings(["--kv-cache-dtype", "float16"]).kv_cache_dtype == "float16"
    assert load_settings(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert s.max_body_bytes == 8 * 1024 * 1024
    assert s.cache_dir == Path.home() / ".cache" / "peregrine"
    assert not s.auth_enabled and not s.use_ray


def test_flags_beat_env_beat_dotenv(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    (clean_env / ".env").write_text(
        "PEREGRINE_PORT=7001\nPEREGRINE_MAX_NUM_SEQS=3\nPEREGRINE_LOG_LEVEL=debug\n"
    )
    monkeypatch.setenv("PEREGRINE_PORT", "7002")
    monkeypatch.setenv("PEREGRINE_MAX_NUM_SEQS", "4")
    s = load_settings(["--port", "7003"])
    assert s.port == 7003  # flag
    assert s.max_num_seqs == 4  # environment over .env
    assert s.log_level == "debug"  # .env alone


def test_kebab_case_flags_and_bool_flags() -> None:
    s = load_settings(
        [
            "--max-model-len",
            "2048",
            "--kv-cache-memory-fraction",
            "0.25",
            "--skip-preflight",
            "--device",
            "cuda:1",
        ]
    )
    assert (s.max_model_len, s.kv_cache_memory_fraction, s.skip_preflight, s.device) == (
        2048,
        0.25,
        True,
        "cuda:1",
    )
    assert load_settings(["--no-skip-preflight"]).skip_preflight is False


@pytest.mark.parametrize(
    ("text", "expected"), [("2GiB", 2 * 1024**3), ("512MB", 512 * 10**6), ("1048576", 1024**2)]
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert load_settings(["--kv-cache-bytes", text]).kv_cache_bytes == expected


def test_hf_token_from_hf_token_env_and_dotenv(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    (clean_env / ".env").write_text("HF_TOKEN=hf_from_dotenv\n")
    assert load_settings([]).hf_token_value == "hf_from_dotenv"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert load_settings([]).hf_token_value == "hf_from_env"
    monkeypatch.setenv("PEREGRINE_HF_TOKEN", "hf_prefixed")
    assert load_settings([]).hf_token_value == "hf_prefixed"  # the project's own name wins
    assert "hf_prefixed" not in repr(load_settings([]))  # a secret never shows in logs


def test_ray_address_from_ray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert load_settings([]).ray_address == "10.0.0.5:6379"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--port", "70000"], "--port (PEREGRINE_PORT)"),
        (["--device", "gpu"], "--device (PEREGRINE_DEVICE)"),
        (["--dtype", "float8"], "--dtype"),
        (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction"),
        (["--kv-cache-bytes", "lots"], "--kv-cache-bytes"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--root-path", "api"], "--root-path"),
        (["--ray-autoscale", "4:1"], "--ray-autoscale"),
        (["--model", "  "], "--model"),
    ],
)
def test_bad_values_name_the_setting(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises((ConfigError, SystemExit)) as info:
        load_settings(argv)
    if isinstance(info.value, SystemExit):  # argparse refused it (e.g. not one of the choices)
        assert info.value.code == 2
        assert named in capsys.readouterr().err
    else:
        assert named in str(info.value)


def test_bad_env_value_names_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEREGRINE_MAX_NUM_SEQS", "many")
    with pytest.raises(ConfigError, match=r"--max-num-seqs \(PEREGRINE_MAX_NUM_SEQS\).*'many'"):
        load_settings([])


def test_secret_values_are_not_echoed_in_errors(monkeypatch: pytest.MonkeyPatch, clean_env: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(["--api-keys-file", str(clean_env / "missing.txt"), "--jwt-secret", "s3cret-value"])
    assert "--api-keys-file (PEREGRINE_API_KEYS_FILE): no such file" in str(info.value)
    assert "missing.txt" in str(info.value)
    assert "s3cret-value" not in str(info.value)


def test_api_keys_from_flag_and_file(clean_env: Path) -> None:
    keys = clean_env / "keys.txt"
    keys.write_text("# team keys\nkey-b\n\n  key-c  \n")
    s = load_settings(["--api-keys", "key-a, ,key-x", "--api-keys-file", str(keys)])
    assert s.api_key_list == ("key-a", "key-x", "key-b", "key-c")
    assert s.auth_enabled


def test_ray_autoscale_bounds() -> None:
    s = load_settings(["--ray-autoscale", "1:4"])
    assert s.ray_autoscale_bounds == (1, 4) and s.use_ray
    assert load_settings(["--ray-replicas", "2"]).use_ray


def test_model_id_derivation(clean_env: Path) -> None:
    assert load_settings([]).model_id == "smollm2"
    assert load_settings(["--model", "Qwen/Qwen2.5-7B-Instruct"]).model_id == "Qwen/Qwen2.5-7B-Instruct"
    gguf = clean_env / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_settings(["--model", str(gguf)]).model_id == "tiny.Q4_0"
    assert load_settings(["--served-model-name", "mine"]).model_id == "mine"


def test_settings_are_frozen() -> None:
    s = load_settings([])
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]


def test_constructor_does_not_read_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["pytest", "--port", "1"])
    assert Settings().port == 8000  # only load_settings parses flags


def run_main(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_every_flag_with_default(clean_env: Path) -> None:
    result = run_main("--help", cwd=clean_env)
    assert result.returncode == 0, result.stderr
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in result.stdout, name
    assert "(default: bundled:smollm2)" in result.stdout
    assert "(default: 127.0.0.1)" in result.stdout


def test_bad_flag_exits_2_with_one_clean_line(clean_env: Path) -> None:
    result = run_main("--port", "99999", cwd=clean_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "main.py: error: --port (PEREGRINE_PORT): Input should be less than or equal to 65535, got '99999'"
    ]


def test_unknown_flag_exits_2(clean_env: Path) -> None:
    result = run_main("--no-such-flag", cwd=clean_env)
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr and "Traceback" not in result.stderr


def test_generation_defaults_are_checked_and_fill_only_what_a_request_leaves_out() -> None:
    from app.openai.convert import to_sampling_params
    from app.openai.schemas import ChatCompletionRequest

    settings = load_settings(["--override-generation-config", '{"temperature": 0, "top_k": 5, "max_new_tokens": 7}'])
    defaults = settings.override_generation_config
    assert defaults == {"temperature": 0, "top_k": 5, "max_tokens": 7}
    bare = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    params = to_sampling_params(bare, 100, defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.top_p) == (0, 5, 7, 1.0)
    own = bare.model_copy(update={"temperature": 0.7, "top_k": -1, "max_tokens": 3})
    params = to_sampling_params(own, 100, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 0, 3)
    assert to_sampling_params(bare, 100).temperature == 1.0, "no defaults: OpenAI's"
    with pytest.raises(ConfigError, match="unknown key.*seed"):
        load_settings(["--override-generation-config", '{"seed": 1}'])
    with pytest.raises(ConfigError, match="override_generation_config"):
        load_settings(["--override-generation-config", "not json"])
