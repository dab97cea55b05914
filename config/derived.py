"""What Settings derives from its fields (properties, not settings: no flag, no variable): config/settings.py's
`Settings` inherits them."""

from __future__ import annotations

import os
from pathlib import Path

from config.loading import parse_duration


class DerivedValues:
    """Derived values of Settings' fields (the fields are declared on Settings, whose instances these run on)."""

    @property
    def api_key_list(self) -> tuple[str, ...]:
        """Every accepted API key: from --api-keys and from --api-keys-file (blank lines and # comments skipped)."""
        keys = [k.strip() for k in (self.api_keys.get_secret_value() if self.api_keys else "").split(",")]
        if self.api_keys_file is not None:
            lines = self.api_keys_file.read_text(encoding="utf-8").splitlines()
            keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
        return tuple(k for k in keys if k)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_key_list) or self.jwt_secret is not None

    @property
    def ray_autoscale_bounds(self) -> tuple[int, int] | None:
        if self.ray_autoscale is None:
            return None
        low, high = self.ray_autoscale.split(":")
        return int(low), int(high)

    @property
    def use_ray(self) -> bool:
        """Serve through Ray Serve (several replicas, or autoscaling) instead of one in-process engine."""
        return self.ray_replicas > 1 or self.ray_autoscale is not None

    @property
    def multi_model(self) -> bool:
        """Several models in one server (config.models_file.py, serving/registry.py) instead of one engine."""
        return bool(self.extra_models) or self.models_file is not None

    @property
    def model_keep_alive_s(self) -> float:
        """Seconds a model stays loaded when idle; negative: forever."""
        return parse_duration(self.model_keep_alive)

    @property
    def store_max_age_s(self) -> float:
        """Seconds a stored object is kept; negative: forever."""
        return parse_duration(self.store_max_age)

    @property
    def hf_token_value(self) -> str | None:
        return self.hf_token.get_secret_value() if self.hf_token else None

    @property
    def model_id(self) -> str:
        """The id the API reports: --served-model-name, else the model argument without path or suffix."""
        if self.served_model_name:
            return self.served_model_name
        if self.model.startswith("bundled:"):
            return self.model.removeprefix("bundled:")
        if self.model.endswith(".gguf") or os.path.sep in self.model and Path(self.model).exists():
            return Path(self.model).name.removesuffix(".gguf")
        return self.model
