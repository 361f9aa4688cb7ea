"""Device specs used for MFU and roofline columns, and for picking the speed-up baseline file.

Figures are the vendors' datasheet numbers for dense (no sparsity) arithmetic. They are ceilings
to compare against, not promises: a measured matmul on an H100 SXM reaches about 75-80% of the
bf16 figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12
# Byte units, one definition for the package: binary for memory, decimal for sizes on the wire and
# bandwidths (1 MB = 10^6 bytes, 1 GB/s = 10^9 bytes/s), each report saying which it uses.
KIB, MIB, GIB = 2**10, 2**20, 2**30
MB = 10**6
GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    slug: str  # short name used on the command line, in report paths and baseline files
    name: str  # what torch.cuda.get_device_name() reports for this part
    bf16_flops: float  # peak dense bf16 tensor-core FLOP/s
    fp32_flops: float  # peak fp32 FLOP/s on the CUDA cores (no TF32)
    tf32_flops: float  # peak dense TF32 tensor-core FLOP/s
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    # Patterns matched against torch.cuda.get_device_name(), most specific first. The Hopper and
    # Blackwell ones are anchored, so that a part with other figures under a similar name (a GH200 or GB200
    # superchip, an H200 NVL, an H100 NVL) matches none.
    name_patterns: tuple[str, ...] = ()

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s for matmuls run in `precision` ("fp32", "tf32", "bf16" or "fp16")."""
        if precision in ("bf16", "fp16"):
            return self.bf16_flops
        if precision == "tf32":
            return self.tf32_flops
        if precision == "fp32":
            return self.fp32_flops
        raise ValueError(f"unknown precision {precision!r}; expected fp32, tf32, bf16 or fp16")


GPU_SPECS: dict[str, GpuSpec] = {
    spec.slug: spec
    for spec in [
        GpuSpec("a100", "NVIDIA A100-SXM4-80GB", 312 * TERA, 19.5 * TERA, 156 * TERA,
                2.039e12, 80 * GB, (r"A100.*80GB",)),
        GpuSpec("a100-40gb", "NVIDIA A100-SXM4-40GB", 312 * TERA, 19.5 * TERA, 156 * TERA,
                1.555e12, 40 * GB, (r"A100.*40GB", r"A100")),
        GpuSpec("h100", "NVIDIA H100 80GB HBM3", 989.4 * TERA, 66.9 * TERA, 494.7 * TERA,
                3.35e12, 80 * GB, (r"\bH100 80GB HBM3", r"\bH100 SXM", r"\bH100$")),
        GpuSpec("h100-pcie", "NVIDIA H100 PCIe", 756 * TERA, 51.2 * TERA, 378 * TERA,
                2.0e12, 80 * GB, (r"H100 PCIe",)),
        GpuSpec("h200", "NVIDIA H200", 989.4 * TERA, 66.9 * TERA, 494.7 * TERA,
                4.8e12, 141 * GB, (r"\bH200$", r"\bH200 SXM")),
        GpuSpec("b200", "NVIDIA B200", 2250 * TERA, 75 * TERA, 1100 * TERA,
                8.0e12, 180 * GB, (r"\bB200$",)),
    ]
}

# Nominal NVLink bandwidth of one GPU, per direction (half the datasheet's bidirectional figure), in bytes/s:
# NVLink 3 (A100) 600 GB/s, NVLink 4 (H100 SXM, H200) 900 GB/s, NVLink 5 (B200) 1.8 TB/s.
NVLINK_BYTES_PER_S_PER_DIRECTION = {
    "a100": 300 * 10**9, "a100-40gb": 300 * 10**9, "h100": 450 * 10**9, "h200": 450 * 10**9, "b200": 900 * 10**9,
}
NVLINK_GENERATION = {"a100": 3, "a100-40gb": 3, "h100": 4, "h200": 4, "b200": 5}


def spec_for_device_name(device_name: str) -> GpuSpec | None:
    """The spec whose pattern matches a CUDA device name, or None for a GPU not in the table."""
    for spec in GPU_SPECS.values():
        if any(re.search(pattern, device_name) for pattern in spec.name_patterns):
            return spec
    return None


def slugify(device_name: str) -> str:
    """A path-safe name for a device that is not in the table ("NVIDIA L4" -> "nvidia-l4")."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def device_slug(device_name: str) -> str:
    """The report directory of a CUDA device name: its table entry's slug, else the name made path-safe."""
    spec = spec_for_device_name(device_name)
    return spec.slug if spec else slugify(device_name)


def resolve_gpu(choice: str) -> tuple[str, GpuSpec | None]:
    """Map a --gpu choice to (report slug, spec).

    "none" means CPU; "auto" detects the current CUDA device (CPU when there is none); any other
    value must name a table entry, and the GPU this machine has: a name picks the peak figures MFU is
    measured against and the baseline file the gates compare with, so naming another GPU would
    measure one device and report it as another. The slug names the report directory and the
    baseline file.
    """
    import torch

    if choice == "none":
        return "cpu", None
    if choice == "auto":
        if not torch.cuda.is_available():
            return "cpu", None
        device_name = torch.cuda.get_device_name()
        return device_slug(device_name), spec_for_device_name(device_name)
    if choice not in GPU_SPECS:
        known = ", ".join(["auto", "none", *GPU_SPECS])
        raise ValueError(f"unknown GPU {choice!r}; choose one of {known}")
    named = GPU_SPECS[choice].name
    if not torch.cuda.is_available():
        raise ValueError(f"{choice} is the {named}, but torch sees no CUDA GPU on this machine; pass none "
                         "(or auto) to run on the CPU")
    device_name = torch.cuda.get_device_name()
    found = spec_for_device_name(device_name)
    if found is None or found.slug != choice:
        instead = f"{found.slug} or auto" if found else "auto"
        raise ValueError(f"{choice} is the {named}, but this machine's GPU is the {device_name}; pass {instead}")
    return choice, GPU_SPECS[choice]
