"""Problems mixed_precision_accumulation and benchmarking_mixed_precision (a, b): experiments that
return what they measured (cs336_systems.reports.mixed_precision renders them)."""

from __future__ import annotations

import torch
from torch import nn

from cs336_systems.rows import Row
from cs336_systems.rows.mixed_precision import ACCUMULATION_STEPS, ADDEND

# (variant, accumulator dtype, addend dtype, whether the addend is upcast explicitly before adding)
ACCUMULATION_VARIANTS = (
    ("fp32 += fp32", torch.float32, torch.float32, False),
    ("fp16 += fp16", torch.float16, torch.float16, False),
    ("fp32 += fp16", torch.float32, torch.float16, False),
    ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True),
)


def accumulation_experiment() -> list[Row]:
    """Add 0.01 a thousand times in the four ways of the course's snippet; exact answer 10."""
    rows = []
    for variant, accumulator_dtype, addend_dtype, upcast in ACCUMULATION_VARIANTS:
        total = torch.tensor(0, dtype=accumulator_dtype)
        for _ in range(ACCUMULATION_STEPS):
            addend = torch.tensor(ADDEND, dtype=addend_dtype)
            total += addend.to(torch.float32) if upcast else addend
        stored_addend = torch.tensor(ADDEND, dtype=addend_dtype).double().item()
        rows.append({
            "variant": variant,
            "accumulator": str(accumulator_dtype).removeprefix("torch."),
            "addend": str(addend_dtype).removeprefix("torch."),
            "result": total.double().item(),
            "abs_error": abs(total.double().item() - ACCUMULATION_STEPS * ADDEND),
            # What the sum would be with the addend as stored but exact accumulation: the part of
            # the error that comes from representing 0.01, not from adding.
            "exact_sum_of_stored_addend": ACCUMULATION_STEPS * stored_addend,
        })
    return rows


class ToyModel(nn.Module):
    """The course's toy model: fc1 -> ReLU -> LayerNorm -> fc2."""

    def __init__(self, in_features: int = 20, out_features: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


def autocast_dtype_for(device: torch.device) -> torch.dtype:
    """fp16, the dtype the course asks about, unless this device's autocast does not support it."""
    try:
        with torch.autocast(device.type, dtype=torch.float16):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        return torch.float16
    except RuntimeError:
        return torch.bfloat16


def autocast_dtypes_experiment(device: torch.device | str) -> list[Row]:
    """The dtype of each tensor in a toy-model training step under autocast, as observed."""
    device = torch.device(device)
    autocast_dtype = autocast_dtype_for(device)
    torch.manual_seed(0)
    model = ToyModel().to(device)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:
            seen[name] = output.dtype

        return hook

    model.fc1.register_forward_hook(record("fc1 output"))
    model.ln.register_forward_hook(record("layer norm output"))
    x = torch.randn(8, 20, device=device)
    targets = torch.randint(5, (8,), device=device)
    with torch.autocast(device.type, dtype=autocast_dtype):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, targets)
    loss.backward()
    observed = {
        "parameters": {p.dtype for p in model.parameters()},
        "fc1 output": {seen["fc1 output"]},
        "layer norm output": {seen["layer norm output"]},
        "logits": {logits.dtype},
        "loss": {loss.dtype},
        "gradients": {p.grad.dtype for p in model.parameters()},
    }
    name = str(autocast_dtype).removeprefix("torch.")
    return [{"tensor": tensor, "dtype": ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
             "autocast": name, "device": device.type}
            for tensor, dtypes in observed.items()]


NORM_TEST_MAGNITUDE = 300.0  # activations of a few hundred occur in the residual stream of large LMs


def normalization_precision_experiment() -> list[Row]:
    """Mean of squares over a 1024-wide row of magnitude ~300 in fp32, fp16 and bf16.

    Squares of 300 reach 9e4, past fp16's largest finite value (65504): fp16 overflows to inf,
    while bf16 keeps fp32's exponent range and only loses mantissa bits.
    """
    generator = torch.Generator().manual_seed(0)
    x = NORM_TEST_MAGNITUDE * (1 + 0.1 * torch.randn(1024, generator=generator, dtype=torch.float64))
    exact = x.pow(2).mean().item()
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        value = x.to(dtype).pow(2).mean().double().item()
        rows.append({"storage_dtype": str(dtype).removeprefix("torch."), "mean_square": value,
                     "relative_error": abs(value - exact) / exact})
    return rows
