"""What training the LM takes beside the model itself: building it on a device, AdamW over it, a batch of random
tokens, and the loss. Benchmarks, equivalence checks and tests all train it from these.

    model = build_model(ModelConfig.for_size("small", 512), "cuda", attention="naive", seed=0)
    optimizer = adamw(model, lr=LEARNING_RATE)   # the course's AdamW; "fused" for torch's fused kernel
    inputs, targets = random_batch(model.config, 4, 512, "cuda")
    loss = lm_loss(model(inputs), targets)      # or logits_loss(model, inputs, targets)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cs336_systems.accounting.activations import ADAMW_IMPLEMENTATIONS
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.optimizer import AdamW

LEARNING_RATE = 1e-4


def build_model(config: ModelConfig, device: torch.device | str, attention: str = "sdpa", *,
                dtype: torch.dtype | None = None, seed: int | None = None, compile: bool = False) -> TransformerLM:
    """The LM initialised on `device` (a 2.7B model takes seconds to initialise on a CPU); `seed`
    seeds torch's global generator first, None leaves it as it is; `compile` compiles each block."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = TransformerLM(config, attention=attention)
    if dtype is not None:
        model = model.to(dtype)
    if compile:
        # Start from empty compile caches: entries from earlier models would count towards dynamo's
        # recompile limit, past which it silently falls back to eager.
        torch.compiler.reset()
        # Regional compilation: every block has the same code and shapes, so one compiled graph
        # serves all of them and compile time no longer grows with depth.
        for block in model.layers:
            block.compile()
    return model


def adamw(module: torch.nn.Module, lr: float = LEARNING_RATE,
          implementation: str = "course") -> torch.optim.Optimizer:
    """AdamW over `module`'s parameters, in one of ADAMW_IMPLEMENTATIONS:
    - course: the course model's own (cs336_systems.optimizer.AdamW), one parameter at a time;
    - fused: torch's fused kernel on CUDA (one pass over parameters, gradients and both moments; the
      multi-tensor path takes about three times as long on a 2.7B model), torch's default elsewhere;
    - foreach: torch's default (the multi-tensor path on CUDA), as the distributed benchmarks were
      measured with."""
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"unknown AdamW implementation {implementation!r}; choose one of "
                         f"{', '.join(ADAMW_IMPLEMENTATIONS)}")
    if implementation == "course":
        return AdamW(module.parameters(), lr=lr)
    # None, not False: an explicit False would also turn off the foreach default.
    use_fused = True if implementation == "fused" and next(module.parameters()).is_cuda else None
    return torch.optim.AdamW(module.parameters(), lr=lr, fused=use_fused)


def random_batch(config: ModelConfig, batch_size: int, seq_len: int, device: torch.device | str,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of random token ids, drawn on the CPU from a generator seeded with `seed`, so
    the same on every run and every device."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, seq_len)
    inputs, targets = (torch.randint(config.vocab_size, shape, generator=generator).to(device) for _ in range(2))
    return inputs, targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, low-precision logits upcast to fp32 first: that changes nothing
    under autocast (which runs the loss in fp32) and keeps bf16 logits of low-precision compute
    without autocast from rounding the loss."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def logits_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The LM's loss of a batch, as cs336_systems.distributed.training.Trainer takes it."""
    return lm_loss(model(inputs), targets)
