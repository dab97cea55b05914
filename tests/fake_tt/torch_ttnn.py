"""A stand-in for `torch_ttnn` (torch-ttnn's torch.compile backend), for the suite only: no Tenstorrent card is
here, so its backend runs each graph torch.compile hands it on the CPU, as it is, and records that it was handed
one (tests assert the engine's forward went through it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

compiled: list[torch.fx.GraphModule] = []  # every graph the backend was handed


class TorchTtnnOption:
    def __init__(self, device: Any) -> None:
        self.device = device


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: TorchTtnnOption | None = None,
            **_: Any) -> Callable[..., Any]:
    if options is None or options.device is None:
        raise ValueError("torch_ttnn.backend needs options with an opened device")
    compiled.append(gm)
    return gm.forward
