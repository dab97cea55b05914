"""One backend per device (cpu, cuda, tt): probe, placement, memory, kernels; the C++ sources in csrc/."""
