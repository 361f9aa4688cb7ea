"""Attention in closed form: the memory of naive (materialised) attention op by op, and the FLOPs
the FlashAttention benchmarks divide by.

    memory = naive_attention_memory(batch=8, n_queries=16384, n_keys=16384, head_dim=16, precision="fp32")
    memory.before_backward_bytes, memory.peak_bytes, memory.breakdown()

Naive attention (`cs336_systems.attention.reference.naive_attention`) on q (B, Nq, d) and k, v
(B, Nk, d), any leading dims folded into B, every tensor in the input dtype. Op by op, what each
creates and what autograd saves for backward:

    op                               creates                          autograd saves
    S0 = q @ k^T                     S0 (B, Nq, Nk)                   q and k: the inputs, no new memory
    S1 = S0 / sqrt(d)                S1; S0 is freed                  nothing (divides by a Python float)
    causal: S2 = S1.masked_fill(~m)  m and ~m (Nq, Nk) bools; S2      ~m
    P = softmax(S2)                  P (B, Nq, Nk)                    P, its output
    O = P @ v                        O (B, Nq, d)                     P and v

So what backward needs beyond the inputs is P, one score-sized matrix per batch element (plus the
causal mask, one byte per score, shared over the batch): it grows as N^2 where everything else grows
as N. The scores S are not saved (softmax's gradient needs only its output), but the function's local
variable keeps the last S alive until it returns, so the forward peaks with two score-sized matrices.

Backward, gradients named after the tensors they belong to, and the score-sized matrices alive:
    P @ v                dP = dO v^T (B, Nq, Nk), dv = P^T dO      P, dP
    softmax              dS = P * (dP - rowsum(dP * P))            P, dP, dS (+ dP * P on CUDA) <- the peak
    causal: masked_fill  dS1 = dS.masked_fill(~m, 0)               dS, dS1
    / sqrt(d)            dS0 = dS1 / sqrt(d)                       dS1, dS0
    q @ k^T              dq = dS0 k, dk = dS0^T q                  dS0
The softmax's backward is where the peak falls, and its size depends on the device. On CUDA,
ATen's softmax_backward_cuda_out computes `tmp = grad * output` into a new tensor first and runs
its kernel on tmp and P, so dP * P is a fourth score-sized matrix beside P, dP and dS: four at the
peak. The CPU kernel is fused and needs no temporary: three. (The H100 sweep measured the backward
peak at 4/3 of a three-matrix prediction in every cell from N = 1024 up.) With retain_graph=True P
outlives the softmax step, which keeps that many alive one step longer but not more.

Totals count what the benchmarks hold as well: q, k, v and the output gradient dO, allocated before
the forward. They leave out cuBLAS workspaces, allocator rounding and fragmentation.

FLOPs (self-attention, N queries and N keys). A matmul of (m, k) by (k, n) is 2mkn FLOPs.
Attention's forward is two matmuls, 4 N^2 d per batch element and head; a causal mask leaves about
half the scores (N(N+1)/2), so the useful work is counted as half that. Backward is counted as 2.5x
the forward (five matmuls of that size against the forward's two: FlashAttention-2's recomputation
of S, then dV, dP, dQ, dK), the convention of the FlashAttention papers, applied to every
implementation alike so that TFLOP/s compare like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.checks import check_choice, check_positive_int
from cs336_systems.precision import Precision, check_precision
from cs336_systems.rows.flash import ATTENTION_MODES

BOOL_BYTES = 1
# Score-sized (B, Nq, Nk) matrices alive at the forward's and, per device type, the backward's peak
# (see above).
FORWARD_PEAK_SCORE_MATRICES = 2
BACKWARD_PEAK_SCORE_MATRICES = {"cuda": 4, "cpu": 3}
# Backward over forward FLOPs: five matmuls of the forward's size against its two.
BACKWARD_FLOPS_MULTIPLE = 2.5


@dataclass(frozen=True)
class NaiveAttentionMemory:
    """Bytes of naive attention's tensors; `batch` is the product of the leading dims (batch x heads)."""

    batch: int
    n_queries: int
    n_keys: int
    head_dim: int
    precision: str
    is_causal: bool = False
    device_type: str = "cuda"

    def __post_init__(self):
        check_positive_int(batch=self.batch, n_queries=self.n_queries, n_keys=self.n_keys, head_dim=self.head_dim)
        check_precision(self.precision)
        check_choice("device type", self.device_type, BACKWARD_PEAK_SCORE_MATRICES)

    @property
    def backward_peak_score_matrices(self) -> int:
        return BACKWARD_PEAK_SCORE_MATRICES[self.device_type]

    @property
    def element_bytes(self) -> int:
        return Precision.named(self.precision).bytes_per_element

    @property
    def query_sized_bytes(self) -> int:
        """One (B, Nq, d) tensor: q, the output O or its gradient dO."""
        return self.batch * self.n_queries * self.head_dim * self.element_bytes

    @property
    def key_sized_bytes(self) -> int:
        """One (B, Nk, d) tensor: k, v or their gradients."""
        return self.batch * self.n_keys * self.head_dim * self.element_bytes

    @property
    def inputs_bytes(self) -> int:
        return self.query_sized_bytes + 2 * self.key_sized_bytes

    @property
    def scores_bytes(self) -> int:
        """One (B, Nq, Nk) matrix: the scores, the softmax output P, or a gradient of either."""
        return self.batch * self.n_queries * self.n_keys * self.element_bytes

    @property
    def mask_bytes(self) -> int:
        """One (Nq, Nk) bool mask when causal (broadcast over the batch), else nothing."""
        return self.n_queries * self.n_keys * BOOL_BYTES if self.is_causal else 0

    @property
    def caller_bytes(self) -> int:
        """q, k, v and the output gradient dO, which the caller allocates before the forward."""
        return self.inputs_bytes + self.query_sized_bytes

    @property
    def saved_bytes(self) -> int:
        """What autograd keeps for backward beyond the inputs: P, and the inverted mask when causal."""
        return self.scores_bytes + self.mask_bytes

    @property
    def retained_bytes(self) -> int:
        """What the forward leaves allocated: its output and what it saved for backward."""
        return self.query_sized_bytes + self.saved_bytes

    @property
    def before_backward_bytes(self) -> int:
        return self.caller_bytes + self.retained_bytes

    @property
    def forward_peak_bytes(self) -> int:
        """The last S, P, both masks and O, over the caller's tensors."""
        return (self.caller_bytes + FORWARD_PEAK_SCORE_MATRICES * self.scores_bytes + 2 * self.mask_bytes
                + self.query_sized_bytes)

    @property
    def backward_peak_bytes(self) -> int:
        """P, dP, dS (and on CUDA dP * P) at the softmax step, the saved mask, O and dv (made by the first
        matmul's backward)."""
        return (self.caller_bytes + self.backward_peak_score_matrices * self.scores_bytes + self.mask_bytes
                + self.query_sized_bytes + self.key_sized_bytes)

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def breakdown(self) -> list[dict[str, object]]:
        """One row per tensor of the forward and backward: name, shape, bytes and why it exists."""
        b, nq, nk, d = self.batch, self.n_queries, self.n_keys, self.head_dim
        rows = [
            ("q, k, v", f"({b}, {nq}, {d}) + 2 x ({b}, {nk}, {d})", self.inputs_bytes,
             "inputs; saved by the q @ k^T and P @ v matmuls as references, no copy"),
            ("dO", f"({b}, {nq}, {d})", self.query_sized_bytes, "output gradient, held by the caller"),
            ("scores S", f"({b}, {nq}, {nk})", self.scores_bytes,
             "q @ k^T / sqrt(d); not saved, but two copies coexist during the forward"),
        ]
        if self.is_causal:
            rows.append(("causal mask and its inverse", f"2 x ({nq}, {nk}) bool", 2 * self.mask_bytes,
                         "the inverse is saved by masked_fill for backward"))
        rows += [
            ("softmax output P", f"({b}, {nq}, {nk})", self.scores_bytes,
             "saved for backward by softmax and by P @ v"),
            ("output O", f"({b}, {nq}, {d})", self.query_sized_bytes, "kept by the caller for backward"),
            ("dP, dS", f"2 x ({b}, {nq}, {nk})", 2 * self.scores_bytes,
             "gradients of P and of the scores, alive with P at the softmax's backward"),
        ]
        if self.backward_peak_score_matrices == 4:
            rows.append(("dP * P", f"({b}, {nq}, {nk})", self.scores_bytes,
                         "the CUDA softmax backward's temporary, alive with P, dP and dS"))
        return [{"tensor": name, "shape": shape, "bytes": size, "note": note} for name, shape, size, note in rows]

    def as_row(self) -> dict[str, int]:
        return {"predicted_before_backward_bytes": self.before_backward_bytes,
                "predicted_saved_bytes": self.saved_bytes,
                "predicted_forward_peak_bytes": self.forward_peak_bytes,
                "predicted_backward_peak_bytes": self.backward_peak_bytes}


def naive_attention_memory(batch: int, n_queries: int, n_keys: int, head_dim: int, precision: str,
                           is_causal: bool = False, device_type: str = "cuda") -> NaiveAttentionMemory:
    return NaiveAttentionMemory(batch, n_queries, n_keys, head_dim, precision, is_causal, device_type)


def attention_flops(batch: int, seq_len: int, head_dim: int, is_causal: bool, phase: str) -> float:
    """Useful FLOPs of self-attention over `batch` (batch x heads) sequences, by the convention above."""
    check_positive_int(batch=batch, seq_len=seq_len, head_dim=head_dim)
    check_choice("phase", phase, ATTENTION_MODES)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    forward = 4 * batch * seq_len * seq_len * head_dim
    if is_causal:
        forward /= 2
    return forward * {"forward": 1, "backward": BACKWARD_FLOPS_MULTIPLE,
                      "forward_backward": 1 + BACKWARD_FLOPS_MULTIPLE}[phase]
