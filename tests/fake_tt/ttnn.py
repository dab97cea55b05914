"""A stand-in for Tenstorrent's `ttnn` module, for the suite only: no Tenstorrent card (and no ttnn) is here.

It answers the few calls Peregrine's TT backend makes (engine/backends/tt.py): how many cards there are, and
opening one. Put this folder on `sys.path` (or PYTHONPATH, for a server started as a subprocess) to use it.
"""

from __future__ import annotations

opened: list[Device] = []  # every device the backend opened, in order


class Device:
    def __init__(self, device_id: int) -> None:
        self.device_id = device_id


def GetNumAvailableDevices() -> int:  # noqa: N802  ttnn's own name
    return 1


def open_device(device_id: int = 0) -> Device:
    device = Device(device_id)
    opened.append(device)
    return device
