"""deploy/kuberay/rayservice.yaml stays in sync with config.Settings (no Ray or Kubernetes needed).

Every key under an application's `args:` and every PEREGRINE_* variable (in the Serve runtime_env or a
container's env) must name a Settings field, the values must pass Settings' validation, and the
`import_path` must point at Peregrine's Serve application builder.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from config import ENV_PREFIX, Settings

yaml = pytest.importorskip("yaml")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


@pytest.fixture(scope="module")
def applications(manifest: dict) -> list[dict]:
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    return serve_config["applications"]


def _container_env_names(manifest: dict) -> list[str]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [env["name"] for group in groups for container in group["template"]["spec"]["containers"]
            for env in container.get("env", [])]  # fmt: skip


def test_it_is_a_rayservice(manifest: dict, applications: list[dict]) -> None:
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["kind"] == "RayService"
    assert [app["name"] for app in applications] == ["peregrine"]


def test_args_are_settings_fields_with_valid_values(applications: list[dict]) -> None:
    for app in applications:
        args = app["args"]
        unknown = sorted(set(args) - set(Settings.model_fields))
        assert not unknown, f"args that are not Settings fields: {unknown}"
        Settings(**args)  # raises if a value does not validate


def test_peregrine_variables_are_settings_fields(manifest: dict, applications: list[dict]) -> None:
    names = _container_env_names(manifest)
    names += [name for app in applications for name in app.get("runtime_env", {}).get("env_vars", {})]
    peregrine = [name for name in names if name.startswith(ENV_PREFIX)]
    assert peregrine, "the manifest sets no PEREGRINE_* variable at all"
    unknown = [
        name for name in peregrine if name.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields
    ]
    assert not unknown, f"PEREGRINE_* variables that name no Settings field: {unknown}"


def test_import_path_is_the_application_builder(applications: list[dict]) -> None:
    for app in applications:
        module_name, _, attr = app["import_path"].partition(":")
        builder = getattr(importlib.import_module(module_name), attr)
        assert callable(builder)
