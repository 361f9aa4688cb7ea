"""Named ranges that show up both in torch.profiler traces and in Nsight Systems (NVTX)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


class _Range(AbstractContextManager):
    def __init__(self, name: str):
        self.name = name
        self._record = torch.profiler.record_function(name)
        self._nvtx = torch.cuda.is_available()

    def __enter__(self):
        self._record.__enter__()
        if self._nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc_info):
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(*exc_info)
        return False


def annotate(name: str) -> AbstractContextManager:
    """A range named `name` for profilers; a no-op inside torch.compile, which cannot trace it."""
    if torch.compiler.is_compiling():
        return nullcontext()
    return _Range(name)
