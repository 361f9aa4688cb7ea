"""The precisions a run is asked for, by the names the handout uses, and what each one means.

    spec = Precision.named("bf16")
    spec.dtype               # torch.bfloat16: tensors made in this precision (attention inputs)
    spec.autocast_dtype      # torch.bfloat16: what the model's matmuls run in; None for fp32 (no autocast)
    spec.bytes_per_element   # 2

Model benchmarks keep fp32 parameters and run bf16 and fp16 under autocast; attention benchmarks make
their inputs in the precision's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cs336_systems.checks import check_choice


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype
    autocast_dtype: torch.dtype | None  # None: runs without autocast

    @property
    def bytes_per_element(self) -> int:
        return self.dtype.itemsize

    @staticmethod
    def named(name: str) -> Precision:
        """The precision called `name`; an unknown name is refused with the known ones listed."""
        check_precision(name)
        return PRECISIONS[name]


PRECISIONS = {spec.name: spec for spec in (
    Precision("fp32", torch.float32, autocast_dtype=None),
    Precision("bf16", torch.bfloat16, autocast_dtype=torch.bfloat16),
    Precision("fp16", torch.float16, autocast_dtype=torch.float16),
)}



def check_precision(name: str) -> None:
    """Refuse a precision name the table does not know, listing the ones it does."""
    check_choice("precision", name, PRECISIONS)
