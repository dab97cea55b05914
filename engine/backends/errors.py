"""The backends' one error type, in a module of its own so that every backend and the registry can raise it."""


class DeviceError(RuntimeError):
    """The requested device or dtype cannot be used here. The message says why, for the user."""
