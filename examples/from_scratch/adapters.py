"""The course's adapter functions for the from-scratch implementation: flash.py (FlashAttention-2 in PyTorch
and in Triton) and parallel.py (DDP, the sharded optimizer, FSDP).

    pytest --pyargs cs336_systems.conformance --adapters examples/from_scratch/adapters.py
"""

from __future__ import annotations

import torch

from . import flash, parallel


def get_flashattention_autograd_function_pytorch() -> type:
    return flash.FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type:
    return flash.FlashAttention2Triton


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    return parallel.OverlappingDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    return parallel.BucketedDDP(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    pass


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    return parallel.OverlappingDDP(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    return parallel.ShardedOptimizer(params, optimizer_cls, **kwargs)


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    return parallel.FullyShardedDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
