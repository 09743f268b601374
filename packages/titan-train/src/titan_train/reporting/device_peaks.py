"""Peak dense bf16 FLOP/s of common accelerators, from their datasheets, for MFU; and their memory."""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 tensor-core peaks.
PEAK_BF16_FLOPS = {
    "H100 SXM": 989.4e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989.4e12,
    "A100": 312e12,
    "B200": 2.25e15,
    "GB200": 2.5e15,
    "MI250X": 383e12,
    "MI300X": 1307.4e12,
    "MI325X": 1307.4e12,
}


def peak_flops_for_name(name: str) -> float | None:
    """Peak bf16 FLOP/s of the accelerator `torch.cuda.get_device_name` calls `name`, or None if unlisted."""
    if "H100" in name:
        key = "H100 NVL" if "NVL" in name else "H100 PCIe" if "PCIe" in name else "H100 SXM"
        return PEAK_BF16_FLOPS[key]
    # GB200 before B200: the name of one contains the other.
    for key in ("GB200", "B200", "H200", "A100", "MI300X", "MI325X", "MI250X"):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_flops(device: torch.device) -> float | None:
    """The device's peak bf16 FLOP/s, or None where unknown (a CPU, an unlisted GPU): no MFU then."""
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


# Memory per device in GiB as torch reports it (`total_memory`), for a dry run's headroom.
DEVICE_MEMORY_GIB = {
    "H100": 79.1,
    "H100 NVL": 93.1,
    "H200": 139.8,
    "A100-40GB": 39.4,
    "A100": 79.2,
    "B200": 178.4,
    "GB200": 184.0,
    "MI250X": 64.0,
    "MI300X": 192.0,
    "MI325X": 256.0,
}
