"""The small models the distributed conformance checks train: the course's toy models (the shapes its DDP tests
rely on: 10 features in, 5 out, a frozen bias, a frozen parameter, two layers sharing one weight), and models
shaped for one property each (a branch some ranks skip, layers of one size for bucket plans and shares of
state, a deep stack of Linear layers for FSDP's memory).

None of them knows of ranks: each check wraps one through the implementation's adapters.
"""

from __future__ import annotations

import torch
from torch import nn


class _FrozenBiasLinear(nn.Module):
    """10 -> 50 with a bias that never trains: DDP must leave requires_grad=False parameters alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class ToyModel(nn.Module):
    """The course's: 10 -> 10 -> 50 -> 5 with ReLUs, a frozen bias and a frozen parameter that forward never
    uses."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = _FrozenBiasLinear()
        self.fc3 = nn.Linear(50, 5, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_fixed_param = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class ToyModelWithTiedWeights(nn.Module):
    """The course's: 10 -> 10 -> 50 -> 10 -> 50 -> 5 where both 10 -> 50 layers share one weight tensor."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 10, bias=False)
        self.fc4 = nn.Linear(10, 50, bias=False)
        self.fc5 = nn.Linear(50, 5, bias=False)
        self.fc4.weight = self.fc2.weight
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.fc1, self.fc2, self.fc3, self.fc4):
            x = self.relu(layer(x))
        return self.fc5(x)


TOY_FEATURES_IN, TOY_FEATURES_OUT = 10, 5


class BranchyModel(nn.Module):
    """10 -> 8 -> 5 with a branch that forward may skip and a layer it never uses: neither gets a gradient
    then, on some ranks or on all."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(TOY_FEATURES_IN, 8)
        self.branch = nn.Linear(8, 8)
        self.never_used = nn.Linear(8, 8)
        self.head = nn.Linear(8, TOY_FEATURES_OUT)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class LayerStack(nn.Module):
    """`layers` Linear layers of `width` features each (weight and bias, all trained) with ReLUs between:
    parameters of two known sizes, in a known order."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == 0 else layer(torch.relu(x))
        return x


class ToyFSDPModel(nn.Module):
    """The course's FSDP toy: Embedding -> RMSNorm -> Linear -> ReLU -> RMSNorm -> Linear -> LM head, built from
    cs336_basics' layers (the classes an implementation's FSDP recognises). Its weights, 37 x 10 (the
    embedding and the LM head), 22 x 10 and 10 x 22, have sizes that 3 does not divide."""

    VOCAB_SIZE = 37

    def __init__(self, vocab_size: int = VOCAB_SIZE, d_model: int = 10, d_ff: int = 22):
        super().__init__()
        from cs336_basics.model import Embedding, Linear, RMSNorm

        self.embedding = Embedding(vocab_size, d_model)
        self.norm1 = RMSNorm(d_model)
        self.linear1 = Linear(d_model, d_ff)
        self.norm2 = RMSNorm(d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.embedding(token_ids))
        x = self.norm2(torch.relu(self.linear1(x)))
        return self.lm_head(self.linear2(x))


class FSDPLayerStack(nn.Module):
    """An embedding, `layers` square Linear layers each after an RMSNorm, and an LM head, all `width` x
    `width`: many weights of one size, so that a few gathered at once are a small share of them all, and
    activations (a few tokens) small beside any weight."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        from cs336_basics.model import Embedding, Linear, RMSNorm

        self.vocab_size = width
        self.embedding = Embedding(width, width)
        self.norms = nn.ModuleList(RMSNorm(width) for _ in range(layers))
        self.layers = nn.ModuleList(Linear(width, width) for _ in range(layers))
        self.lm_head = Linear(width, width)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(token_ids)
        for norm, layer in zip(self.norms, self.layers):
            x = torch.relu(layer(norm(x)))
        return self.lm_head(x)


def sharded_weight_names(model: nn.Module) -> set[str]:
    """The names of the weights FSDP shards: those of the model's Linear and Embedding layers (cs336_basics'
    classes, or torch's)."""
    from cs336_basics.model import Embedding, Linear

    kinds = (Linear, Embedding, nn.Linear, nn.Embedding)
    return {f"{name}.weight" if name else "weight" for name, module in model.named_modules() if type(module) in kinds}
