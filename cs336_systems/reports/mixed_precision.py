"""Problem mixed_precision_accumulation's report: the four accumulation variants and what their errors
show (the package's benchmarks/mixed_precision.py measures them)."""

from __future__ import annotations

import math

from cs336_systems.reports import Reports, not_in_report
from cs336_systems.reports.spec import Column, Table
from cs336_systems.rows import Row
from cs336_systems.rows.mixed_precision import ACCUMULATION_STEPS, ADDEND

# Sums to show: the variants differ from 10 in the fourth decimal place and beyond (10.0001 against
# 10.0021), which a table rounded to two decimals would hide.
SUM_DIGITS = 6


ACCUMULATION_TABLE = Table(columns=(
    "variant", "accumulator", "addend", Column("result", lambda r: f"{r['result']:.{SUM_DIGITS}f}"),
    Column("abs_error", lambda r: f"{r['abs_error']:.3g}"),
    Column("exact_sum_of_stored_addend", lambda r: f"{r['exact_sum_of_stored_addend']:.{SUM_DIGITS}f}")))
accumulation_table = ACCUMULATION_TABLE.render  # the accumulation command prints it too


def setup(rows: list[Row]) -> str:
    return f"Adding {ADDEND} {ACCUMULATION_STEPS} times; the exact sum is {ACCUMULATION_STEPS * ADDEND:g}.\n"


def findings(rows: list[Row]) -> str:
    by_variant = {r["variant"]: r for r in rows}
    fp32, fp16, mixed = (by_variant.get(v) for v in ("fp32 += fp32", "fp16 += fp16", "fp32 += fp16"))
    if not (fp32 and fp16 and mixed):
        return ""
    return (f"An fp32 accumulator is off by {fp32['abs_error']:.2g}. An fp16 accumulator is off by "
            f"{fp16['abs_error']:.2g}: once the running sum is large, fp16's spacing (2^-7 = 0.0078 between 8 and 16) "
            "is comparable to the addend, so each addition rounds away a large part of it. With an fp32 accumulator "
            f"and fp16 addends the error ({mixed['abs_error']:.2g}) is exactly the error of storing 0.01 in fp16: the "
            f"sum equals {ACCUMULATION_STEPS} x fp16(0.01) = {mixed['exact_sum_of_stored_addend']:.6g}. Explicit and "
            "implicit upcasting give the same result. Hence mixed precision keeps accumulations (matmul "
            "accumulators, reductions, optimizer state) in fp32 while inputs may be low precision.\n")


# ---------------------------------------------------------------------------------------------- answers

def answer_mixed_precision_accumulation(reports: Reports) -> list[str]:
    variants = {r["variant"]: r for r in reports["mixed_precision_accumulation"]}
    if not variants:
        return [not_in_report("An accumulation variant")]
    sentences = [f"Adding {ADDEND:g} {ACCUMULATION_STEPS} times (exact sum {ADDEND * ACCUMULATION_STEPS:g}): "
                 + "; ".join(f"{name} gives {r['result']:.6g} (error {r['abs_error']:.3g})"
                             for name, r in variants.items()) + "."]
    pure, mixed = variants.get("fp16 += fp16"), variants.get("fp32 += fp16")
    if pure and mixed and math.isclose(mixed["result"], mixed["exact_sum_of_stored_addend"], rel_tol=1e-9):
        sentences.append(
            f"With an fp32 accumulator the fp16 addend costs only its own rounding ({ACCUMULATION_STEPS} x "
            f"fp16({ADDEND:g}) = {mixed['exact_sum_of_stored_addend']:.6g}), while the fp16 accumulator's error is "
            f"{pure['abs_error'] / mixed['abs_error']:.0f}x larger as its spacing grows with the sum: accumulate in "
            "fp32.")
    return sentences
