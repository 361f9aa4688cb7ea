"""Comparisons whose failures say what is wrong, not only by how much: a gradient that is the world size times
the single-process one was summed, not averaged; one equal to the rank's own was never averaged at all.

    problem = gradient_problem("rank 1's fc1.weight", got, single_process, own=rank_own, world_size=2,
                               tolerance=FLOAT64)
    fail_if([problem, ...], "after one step")          # CheckFailed naming each problem, or nothing
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cs336_systems.conformance.rank_checks import CheckFailed


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol {self.rtol:g}, atol {self.atol:g}"

    def close(self, got: torch.Tensor, expected: torch.Tensor) -> bool:
        return got.shape == expected.shape and torch.allclose(got.to(expected.dtype), expected, rtol=self.rtol,
                                                              atol=self.atol)


def scale_of(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The factor s for which s * expected is closest to got (least squares): 2.00 for a gradient summed
    over two ranks where it should have been averaged."""
    expected = expected.double().flatten()
    norm = (expected @ expected).item()
    return float("nan") if norm == 0 else (got.double().flatten() @ expected).item() / norm


def largest_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.double() - expected.double()).abs().max().item()


def gradient_problem(what: str, got: torch.Tensor | None, expected: torch.Tensor, *, world_size: int,
                     tolerance: Tolerance, own: torch.Tensor | None = None) -> str | None:
    """None when `got` (what's gradient) matches the single-process gradient `expected`; otherwise a sentence
    naming the mistake it shows: summed, not averaged; this rank's own gradient (`own`), never averaged;
    missing; or else its scale and largest difference."""
    if got is None:
        return f"{what} is None where single-process training has a gradient"
    if got.shape != expected.shape:
        return f"{what} has shape {tuple(got.shape)}, the parameter {tuple(expected.shape)}"
    if tolerance.close(got, expected):
        return None
    scale = scale_of(got, expected)
    if tolerance.close(got, expected * world_size):
        return f"gradients were summed, not averaged: {what} is {scale:.2f}x the single-process one"
    if own is not None and tolerance.close(got, own):
        return (f"gradients were not averaged over ranks: {what} is this rank's own, from its shard of the batch "
                f"alone ({scale:.2f}x the single-process one)")
    return (f"{what} is {scale:.2f}x the single-process one and differs from it by up to "
            f"{largest_difference(got, expected):.3g}")


# Problems a failure lists before it only counts the rest: the first few say what is wrong.
PROBLEMS_SHOWN = 8


def fail_if(problems: list[str | None], context: str = "") -> None:
    """Raise CheckFailed listing the problems (Nones are none), after `context`; nothing when there are none."""
    found = [problem for problem in problems if problem]
    if found:
        shown = found[:PROBLEMS_SHOWN]
        if len(found) > len(shown):
            shown.append(f"... and {len(found) - len(shown)} more")
        lead = f"{context}:\n  " if context else ""
        raise CheckFailed(lead + "\n  ".join(shown))
