"""Load-time probes that pick the dtype and weight format by timing the loaded model."""
