"""This project's implementations of the course's adapter functions (cs336_systems.conformance.contract
lists them): the default implementation under test, and what tests/adapters.py gives the course's own test
files, so that they run unchanged against this project.

Thin by design: each returns or calls a class from cs336_systems.
"""

from __future__ import annotations

import torch

__all__ = [
    "get_flashattention_autograd_function_pytorch",
    "get_flashattention_autograd_function_triton",
    "get_ddp_individual_parameters",
    "ddp_individual_parameters_on_after_backward",
    "get_ddp_bucketed",
    "ddp_bucketed_on_after_backward",
    "ddp_bucketed_on_train_batch_start",
    "get_ddp",
    "ddp_on_after_backward",
    "get_fsdp",
    "fsdp_on_after_backward",
    "fsdp_gather_full_params",
    "get_sharded_optimizer",
]


def get_flashattention_autograd_function_pytorch() -> type:
    """The FlashAttention-2 autograd.Function written in plain PyTorch (tiled, online softmax)."""
    from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch

    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> type:
    """The FlashAttention-2 autograd.Function whose forward and backward are Triton kernels."""
    from cs336_systems.attention.flash_triton import FlashAttentionTriton

    return FlashAttentionTriton


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """DDP that all-reduces each gradient asynchronously as soon as backward produces it."""
    from cs336_systems.distributed.ddp import OverlapIndividualDDP

    return OverlapIndividualDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    """DDP that all-reduces gradients in buckets of at most bucket_size_mb, overlapping backward."""
    from cs336_systems.distributed.ddp import BucketedDDP

    return BucketedDDP(module, bucket_size_mb=bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.on_train_batch_start()


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """The 2026 name for DDP with per-parameter asynchronous all-reduce."""
    return get_ddp_individual_parameters(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP: Linear and Embedding weights sharded across ranks, optional compute-dtype cast."""
    from cs336_systems.distributed.fsdp import FSDP

    return FSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters by name; replicated parameters as they are."""
    return fsdp_model.gather_full_params()


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    """An optimizer that keeps state for about 1/world_size of the parameters on each rank."""
    from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)
