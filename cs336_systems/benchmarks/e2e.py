"""End-to-end model benchmarks (problems benchmarking_script, benchmarking_mixed_precision and the
whole-model part of torch_compile).

`benchmark_model` builds the LM, draws random tokens, runs `warmup` untimed steps and `steps`
timed ones. In "train" mode every step is forward, backward and an AdamW step, each phase timed on
its own with the device synchronised at every boundary, so one loop yields the forward,
forward+backward and full-step times (forward is measured with autograd recording, as in
training). "forward" mode times inference (no autograd) alone; "forward_backward" leaves the
optimizer out.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from cs336_systems.accounting.flops import step_flops
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling.ranges import annotate
from cs336_systems.reports import OOM, Rendered, Row, renderer
from cs336_systems.timing import synchronize, timed

MODES = ("forward", "forward_backward", "train")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The phases each mode reports, in order; the composite ones are sums of the measured phases.
PHASES = {
    "forward": ("forward",),
    "forward_backward": ("forward", "backward", "forward_backward"),
    "train": ("forward", "backward", "optimizer", "forward_backward", "train_step"),
}
DEFAULT_WARMUP = 5
DEFAULT_STEPS = 10
DEFAULT_BATCH_SIZE = 4


@dataclass(frozen=True)
class E2EConfig:
    size: str
    context_length: int
    batch_size: int = DEFAULT_BATCH_SIZE
    mode: str = "train"
    precision: str = "fp32"
    compile: bool = False
    attention: str = "sdpa"
    warmup: int = DEFAULT_WARMUP
    steps: int = DEFAULT_STEPS
    # The model's maximum context; None means the benchmark's context length.
    model_context_length: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.warmup < 0:
            raise ValueError(f"warm-up steps must be >= 0, got {self.warmup}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.context_length < 1:
            raise ValueError(f"context length must be >= 1, got {self.context_length}")
        model = self.model_config()  # validates the size
        if self.context_length > model.context_length:
            raise ValueError(f"context length {self.context_length} exceeds the model's context length "
                             f"{model.context_length}")

    def model_config(self) -> ModelConfig:
        return ModelConfig.for_size(self.size, self.model_context_length or self.context_length)


def autocast(precision: str, device: torch.device):
    """bf16/fp16 autocast on `device`, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def build_model(config: ModelConfig, attention: str, device: torch.device, compile: bool) -> TransformerLM:
    model = TransformerLM(config, attention=attention).to(device)
    if compile:
        # Regional compilation: every block has the same code and shapes, so one compiled graph
        # serves all of them and compile time no longer grows with depth.
        for block in model.layers:
            block.compile()
    return model


def _random_batch(config: ModelConfig, batch_size: int, seq_len: int, device: torch.device,
                  generator: torch.Generator):
    shape = (batch_size, seq_len)
    inputs = torch.randint(config.vocab_size, shape, generator=generator).to(device)
    targets = torch.randint(config.vocab_size, shape, generator=generator).to(device)
    return inputs, targets


def _measure(cfg: E2EConfig, device: torch.device) -> tuple[dict[str, list[float]], float]:
    """Per-phase samples in ms over the timed steps, and the first step's wall time in ms."""
    generator = torch.Generator().manual_seed(0)
    config = cfg.model_config()
    model = build_model(config, cfg.attention, device, cfg.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if cfg.mode == "train" else None
    inputs, targets = _random_batch(config, cfg.batch_size, cfg.context_length, device, generator)
    samples: dict[str, list[float]] = {phase: [] for phase in ("forward", "backward", "optimizer")}
    first_step_ms = float("nan")

    def step(record: bool) -> None:
        sink = samples if record else {phase: [] for phase in samples}
        if cfg.mode == "forward":
            with annotate("forward"), timed(device, sink["forward"]), torch.no_grad(), autocast(cfg.precision, device):
                model(inputs)
            return
        with annotate("forward"), timed(device, sink["forward"]), autocast(cfg.precision, device):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with annotate("backward"), timed(device, sink["backward"]):
            loss.backward()
        if optimizer is not None:
            with annotate("optimizer"), timed(device, sink["optimizer"]):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    for i in range(cfg.warmup):
        with annotate("warmup"):
            start = time.perf_counter()
            step(record=False)
            if i == 0:
                first_step_ms = (time.perf_counter() - start) * 1e3
    for i in range(cfg.steps):
        with annotate(f"step_{i}"):
            start = time.perf_counter()
            step(record=True)
            if i == 0 and cfg.warmup == 0:
                first_step_ms = (time.perf_counter() - start) * 1e3
    synchronize(device)
    return samples, first_step_ms


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def benchmark_model(cfg: E2EConfig, device: torch.device | str, peak_flops: float | None = None) -> list[Row]:
    """Rows, one per reported phase: mean / std / median ms and, given a peak, TFLOP/s and MFU.

    A configuration that runs out of device memory gives rows with status "OOM".
    """
    device = torch.device(device)
    base: Row = {k: v for k, v in asdict(cfg).items() if k != "model_context_length"}
    _free_device_memory(device)
    try:
        samples, first_step_ms = _measure(cfg, device)
    except torch.OutOfMemoryError:
        samples = None
    peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    _free_device_memory(device)
    if samples is None:
        return [{**base, "phase": phase, "status": OOM} for phase in PHASES[cfg.mode]]

    samples["forward_backward"] = [f + b for f, b in zip(samples["forward"], samples["backward"])]
    samples["train_step"] = [fb + o for fb, o in zip(samples["forward_backward"], samples["optimizer"])]
    rows = []
    for phase in PHASES[cfg.mode]:
        series = torch.tensor(samples[phase], dtype=torch.float64)
        row = {**base, "phase": phase, "status": "ok",
               "mean_ms": series.mean().item(),
               "std_ms": series.std().item() if len(series) > 1 else 0.0,
               "median_ms": series.median().item(),
               "first_ms": series[0].item(),
               "max_ms": series.max().item(),
               "first_step_ms": first_step_ms,
               "peak_memory_gib": None if peak_memory is None else peak_memory / 2**30}
        flops = step_flops(cfg.model_config(), cfg.batch_size, cfg.context_length,
                           "forward" if cfg.mode == "forward" else phase)
        if flops is not None:
            row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
            if peak_flops:
                row["mfu"] = flops / (row["median_ms"] * 1e-3) / peak_flops
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ reports

PHASE_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "forward_backward": "forward+backward", "train_step": "train step"}


def mean_std(row: Row) -> str:
    return OOM if row.get("status") == OOM else f"{row['mean_ms']:.1f} ± {row['std_ms']:.1f}"


def _sweep_setup(rows: list[Row]) -> str:
    sample = next((r for r in rows if r.get("status") == "ok"), rows[0])
    return (f"batch {sample['batch_size']}, {sample['attention']} attention, AdamW, random tokens, "
            f"{sample['warmup']} warm-up + {sample['steps']} timed steps; times in ms, mean ± std")


def _sweep_table(rows: list[Row]) -> str:
    from cs336_systems.reports import markdown_table, pivot

    ordered = sorted(rows, key=lambda r: (_size_order(r["size"]), list(PHASE_LABELS).index(r["phase"]),
                                          r["context_length"]))
    table = pivot([{**r, "phase": PHASE_LABELS[r["phase"]]} for r in ordered],
                  index=["size", "phase"], column="context_length", value="mean_ms", fmt=mean_std)
    return markdown_table(table)


def _size_order(size: str) -> int:
    from cs336_systems.model import MODEL_SIZES

    return list(MODEL_SIZES).index(size) if size in MODEL_SIZES else len(MODEL_SIZES)


def _relative_std_summary(rows: list[Row]) -> str:
    measured = [r for r in rows if r.get("status") == "ok" and r["mean_ms"] > 0]
    if not measured:
        return "No cell ran (all out of memory)."
    worst = max(measured, key=lambda r: r["std_ms"] / r["mean_ms"])
    spreads = sorted(r["std_ms"] / r["mean_ms"] for r in measured)
    return (f"The standard deviation is small: the median cell's std is {spreads[len(spreads) // 2]:.1%} of its "
            f"mean; the largest is {worst['std_ms'] / worst['mean_ms']:.1%} ({worst['size']}, context "
            f"{worst['context_length']}, {PHASE_LABELS[worst['phase']]}, {worst['mean_ms']:.1f} ms).")


def _warmup_section(rows: list[Row]) -> str:
    from cs336_systems.reports import markdown_table

    ok = [r for r in rows if r.get("status") == "ok"]
    if not rows:
        return ""
    table = []
    for r in sorted(rows, key=lambda r: (_size_order(r["size"]), r["warmup"], list(PHASE_LABELS).index(r["phase"]))):
        if r["phase"] not in ("forward", "backward", "optimizer"):
            continue
        table.append({"size": r["size"], "warm-up steps": r["warmup"], "phase": r["phase"],
                      "mean ± std (ms)": mean_std(r), "max (ms)": r.get("max_ms"),
                      "first timed step (ms)": r.get("first_ms")})
    text = [f"## Warm-up study\n\nEach cell runs in a fresh process (so nothing is warm from an earlier cell): "
            f"context {rows[0]['context_length']}, {rows[0]['steps']} timed training steps after 0, 1, 2 or 5 "
            "warm-up steps.\n", markdown_table(table)]
    findings = []
    for size in sorted({r["size"] for r in ok}, key=_size_order):
        by_warmup = {r["warmup"]: r for r in ok if r["size"] == size and r["phase"] == "forward"}
        if 0 in by_warmup and max(by_warmup) > 0:
            cold, warm = by_warmup[0], by_warmup[max(by_warmup)]
            findings.append(
                f"- {size}: with no warm-up the forward pass averages {cold['mean_ms']:.1f} ms "
                f"(std {cold['std_ms']:.1f}, first step {cold['first_ms']:.1f} ms) against "
                f"{warm['mean_ms']:.1f} ms (std {warm['std_ms']:.1f}) after {max(by_warmup)} warm-up steps.")
    if findings:
        text.append("\n" + "\n".join(findings) + "\n\nThe first step pays one-time costs: CUDA context and "
                    "cuBLAS handle creation, lazy loading of each kernel the first time it runs, the caching "
                    "allocator growing its pool, and (compiled cells) compilation. One warm-up step absorbs "
                    "most of it; a second covers what only appears from the second step on, such as "
                    "AdamW's lazily created state and allocator blocks of the backward pass.\n")
    return "\n".join(text)


@renderer("benchmarking_script")
def render_benchmarking_script(rows: list[Row]) -> Rendered:
    sweep = [r for r in rows if r.get("table") == "sweep"]
    parts = []
    if sweep:
        parts += [f"## Time per phase by model size and context\n\n{_sweep_setup(sweep)}; fp32, eager.\n",
                  _sweep_table(sweep), _relative_std_summary(sweep) + "\n"]
    parts.append(_warmup_section([r for r in rows if r.get("table") == "warmup"]))
    return Rendered("\n".join(parts))


def _ratio_table(rows: list[Row], key: str, base_value, other_value, base_label: str, other_label: str) -> list[Row]:
    """One row per (size, context, phase[, precision]) with the two variants' times and their ratio."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        index = tuple((k, r[k]) for k in ("size", "context_length", "precision", "phase") if k != key)
        cells.setdefault(index, {})[r[key]] = r
    table = []
    for index, pair in sorted(cells.items(), key=lambda kv: (_size_order(dict(kv[0])["size"]),) + tuple(
            str(v) for _, v in kv[0][1:])):
        base, other = pair.get(base_value), pair.get(other_value)
        entry = {k: (PHASE_LABELS[v] if k == "phase" else v) for k, v in index}
        entry[f"{base_label} (ms)"] = mean_std(base) if base else ""
        entry[f"{other_label} (ms)"] = mean_std(other) if other else ""
        both_ok = base and other and base.get("status") == other.get("status") == "ok"
        entry["speed-up"] = f"{base['median_ms'] / other['median_ms']:.2f}x" if both_ok else ""
        if other and other.get("mfu") is not None:
            entry[f"{other_label} MFU"] = f"{other['mfu']:.1%}"
        table.append(entry)
    return table


@renderer("benchmarking_mixed_precision")
def render_benchmarking_mixed_precision(rows: list[Row]) -> Rendered:
    from cs336_systems.reports import markdown_table

    parts = []
    dtypes = [r for r in rows if r.get("table") == "autocast_dtypes"]
    if dtypes:
        parts += ["## (a) dtypes inside a toy-model step under autocast\n\nObserved with forward hooks on "
                  f"{dtypes[0]['device']}, autocast dtype {dtypes[0]['autocast']}"
                  + ("" if dtypes[0]["autocast"] == "float16" else " (this device's autocast has no fp16)") + ".\n",
                  markdown_table(dtypes, ["tensor", "dtype"]),
                  "Parameters and their gradients stay fp32 (autocast casts copies of the weights for each "
                  "matmul); matmul outputs (fc1, logits) come out in the autocast dtype; layer norm and the "
                  "loss run in fp32, because autocast lists them as ops that need fp32's range.\n"]
    norms = [r for r in rows if r.get("table") == "normalization"]
    if norms:
        parts += ["## (b) why normalisation is kept in fp32\n\nMean of squares of a 1024-wide row of "
                  "magnitude ~300, against a float64 reference:\n", markdown_table(norms, ["dtype", "mean_square", "relative_error"]),
                  "fp16 overflows (its largest finite value is 65504, and 300² is 9e4), so a layer norm or RMSNorm "
                  "computed in fp16 produces inf/NaN; bf16 has fp32's exponent range, so it does not overflow, "
                  "but with 8 mantissa bits its mean carries a visible error. Under bf16 the norms can run in "
                  "bf16 without overflow, yet accumulating the statistics in fp32 is still the safer choice, "
                  "which is what our RMSNorm does.\n"]
    timings = [r for r in rows if r.get("table") == "sweep"]
    if timings:
        parts += [f"## (c) fp32 against bf16 autocast\n\n{_sweep_setup(timings)}; eager. Speed-up is the "
                  "ratio of medians; MFU against the GPU's dense bf16 peak.\n",
                  markdown_table(_ratio_table(timings, "precision", "fp32", "bf16", "fp32", "bf16"))]
    return Rendered("\n".join(parts))


@renderer("torch_compile")
def render_torch_compile(rows: list[Row]) -> Rendered:
    from cs336_systems.reports import markdown_table

    model_rows = [r for r in rows if r.get("table") == "sweep"]
    parts = []
    if model_rows:
        parts += [f"## Whole model: eager against torch.compile\n\n{_sweep_setup(model_rows)}. Compiled "
                  "cells compile each Transformer block (regional compilation: one graph serves every "
                  "block); the first warm-up step, which compiles, is excluded from the timings.\n",
                  markdown_table(_ratio_table(model_rows, "compile", False, True, "eager", "compiled"))]
    return Rendered("\n".join(parts))
