"""The Spring 2026 handout's parallelism calculations, in its own symbols, for one SwiGLU FFN layer.

The layer (the handout's equations 20-23), x of shape (B, D), W1 and W2 (D, D_FF), W3 (D_FF, D):

    x1 = x W1,   x2 = x W2,   z = f(x1) * x2,   y = z W3

B is the number of tokens in the global batch; C a device's FLOP/s; W a device's egress bandwidth in
bytes/s. Weights, activations and everything communicated are FP16 (2 bytes). Only matmuls count as
FLOPs, an (A, B) x (B, C) product taking 2ABC. Collectives are the handout's rings (8.1): an
all-gather or reduce-scatter of an S-byte tensor takes (N - 1) / N * S / W, an all-reduce twice that
(`cs336_systems.accounting.communication`, no latency term). Computation and communication overlap,
so a pass is communication bottlenecked when its communication takes longer than its computation.
The handout's alternate ring all-reduce is `communication.alternate_all_reduce_s`, (N - 1) S / W.

FLOPs. The forward is three matmuls of 2 B D D_FF. The backward (equations 24-30) is six: dz = dy W3^T,
the two products of dx = dx1 W1^T + dx2 W2^T, and dW3 = z^T dy, dW2 = x^T dx2, dW1 = x^T dx1, so
12 B D D_FF. Every strategy below splits that work evenly over its N devices.

Communication per strategy (S in bytes):
    DP       backward: all-reduce dW1, dW2, dW3 over N_DP          S = 3 x 2 D D_FF
    FSDP     forward: all-gather W1, W2, W3 over N_FSDP            S = 6 D D_FF
             backward: all-gather them again, reduce-scatter the three gradients: twice that
    TP       forward: all-reduce y over N_TP; backward: all-reduce dx   S = 2 B D
    FSDP+TP  forward: all-gather each device's TP shards over the FSDP axis, S = 6 D D_FF / N_TP, and
             all-reduce its batch shard's y over the TP axis, S = 2 B D / N_FSDP

Every bound below is exact for the ring: the (N - 1) / N factor is kept, and since compute falls as
1 / N too, each condition becomes linear in N - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cs336_systems.accounting.communication import all_gather_s, all_reduce_s, reduce_scatter_s
from cs336_systems.accounting.parallelism import PASSES
from cs336_systems.checks import check_choice, check_positive, check_positive_int

FP16_BYTES = 2
MATMULS = {"forward": 3, "backward": 6}  # matmuls of 2 B D D_FF each
WEIGHT_MATRICES = 3  # W1, W2, W3, each D x D_FF elements


# ------------------------------------------------------------------------------------ FLOPs

def ffn_flops(B: float, D: int, D_FF: int, phase: str) -> float:
    """Matmul FLOPs of the whole FFN layer over B tokens: 6 B D D_FF forward, 12 B D D_FF backward."""
    check_choice("phase", phase, PASSES)
    check_positive(B=B, D=D, D_FF=D_FF)
    return MATMULS[phase] * 2 * B * D * D_FF


def flops_per_device(B: float, D: int, D_FF: int, N: int, phase: str) -> float:
    """Each of N devices does 1/N of the layer's matmuls (DP, FSDP and TP all split them evenly):
    6 B D D_FF / N forward, 12 B D D_FF / N backward."""
    check_positive_int(N=N)
    return ffn_flops(B, D, D_FF, phase) / N


def _weights_bytes(D: int, D_FF: int) -> float:
    check_positive(D=D, D_FF=D_FF)
    return WEIGHT_MATRICES * FP16_BYTES * D * D_FF


# ---------------------------------------------------------------------------------- 8.2 DP

def dp_backward_comm_s(D: int, D_FF: int, N_DP: int, W: float) -> float:
    """All-reduce of dW1, dW2, dW3 (6 D D_FF bytes): 12 (N_DP - 1) D D_FF / (N_DP W)."""
    return all_reduce_s(_weights_bytes(D, D_FF), N_DP, W)


def dp_max_devices(B: float, C: float, W: float) -> float:
    """N_DP <= 1 + B W / C keeps the backward compute bound.

    12 (N - 1) D D_FF / (N W) <= 12 B D D_FF / (N C)  <=>  N - 1 <= B W / C."""
    check_positive(B=B, C=C, W=W)
    return 1 + B * W / C


# -------------------------------------------------------------------------------- 8.3 FSDP

def fsdp_comm_s(D: int, D_FF: int, N_FSDP: int, W: float, phase: str) -> float:
    """Forward: all-gather W1, W2, W3, 6 (N - 1) D D_FF / (N W). Backward: all-gather them again and
    reduce-scatter the gradients, 12 (N - 1) D D_FF / (N W)."""
    check_choice("phase", phase, PASSES)
    size = _weights_bytes(D, D_FF)
    gather = all_gather_s(size, N_FSDP, W)
    return gather if phase == "forward" else gather + reduce_scatter_s(size, N_FSDP, W)


def fsdp_max_devices(B: float, C: float, W: float, phase: str) -> float:
    """N_FSDP <= 1 + B W / C in both passes: the backward doubles both the FLOPs and the traffic.

    forward  6 (N - 1) D D_FF / (N W) <= 6 B D D_FF / (N C);  backward: both sides times 2."""
    check_choice("phase", phase, PASSES)
    return dp_max_devices(B, C, W)


# ---------------------------------------------------------------------------------- 8.4 TP

def tp_comm_s(B: float, D: int, N_TP: int, W: float) -> float:
    """All-reduce of the (B, D) partial sums, y in the forward, dx in the backward: 4 (N - 1) B D / (N W)."""
    check_positive(B=B, D=D)
    return all_reduce_s(FP16_BYTES * B * D, N_TP, W)


def tp_max_devices(D_FF: int, C: float, W: float, phase: str) -> float:
    """N_TP <= 1 + 3 D_FF W / (2 C) forward, 1 + 3 D_FF W / C backward: the same (B, D) all-reduce
    against 6 or 12 B D D_FF / N FLOPs, so the batch cancels.

    forward  4 (N - 1) B D / (N W) <= 6 B D D_FF / (N C)  <=>  N - 1 <= 3 D_FF W / (2 C)."""
    check_choice("phase", phase, PASSES)
    check_positive(D_FF=D_FF, C=C, W=W)
    return 1 + (MATMULS[phase] / 2) * D_FF * W / C


@dataclass(frozen=True)
class TPActivations:
    """What device i saves from its forward: the input x and its shards x1, x2 and z."""
    x: torch.Tensor
    x1: torch.Tensor
    x2: torch.Tensor
    z: torch.Tensor


TP_BACKWARD_EQUATIONS = (
    "dz(i)   = dY W3(i)^T                              (B, D_FF / N_TP)",
    "dx2(i)  = dz(i) * f(x1(i))",
    "dx1(i)  = dz(i) * f'(x1(i)) * x2(i)",
    "dW3(i)  = z(i)^T dY                               (D_FF / N_TP, D)",
    "dW2(i)  = x^T dx2(i)                              (D, D_FF / N_TP)",
    "dW1(i)  = x^T dx1(i)                              (D, D_FF / N_TP)",
    "dx~(i)  = dx1(i) W1(i)^T + dx2(i) W2(i)^T         (B, D), device i's partial sum",
    "dx      = all-reduce({dx~(i)})                    (B, D), the same on every device",
)


def tp_backward(dY: torch.Tensor, shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                saved: list[TPActivations], all_reduce=sum):
    """TP_BACKWARD_EQUATIONS with f = SiLU: per device (dW1(i), dW2(i), dW3(i)), and dx.

    `shards` are each device's (W1(i), W2(i), W3(i)); every device holds the same dY, since y was
    all-reduced. The weight gradients need no communication (each device owns its columns of D_FF);
    the two input-gradient products are summed locally and all-reduced once.
    """
    gradients, partial = [], []
    for (w1, w2, w3), a in zip(shards, saved):
        dz = dY @ w3.T
        sigmoid = torch.sigmoid(a.x1)
        silu = a.x1 * sigmoid
        silu_prime = sigmoid * (1 + a.x1 * (1 - sigmoid))
        dx2 = dz * silu
        dx1 = dz * silu_prime * a.x2
        gradients.append((a.x.T @ dx1, a.x.T @ dx2, a.z.T @ dY))
        partial.append(dx1 @ w1.T + dx2 @ w2.T)
    return gradients, all_reduce(partial)


# ---------------------------------------------------------------------------------- 8.5 FSDP + TP

@dataclass(frozen=True)
class AxisTimes:
    """The forward's two collectives on one device of an N_FSDP x N_TP mesh, in seconds."""
    fsdp_s: float  # all-gather of this device's TP shards of W1, W2, W3 over the FSDP axis
    tp_s: float  # all-reduce of this batch shard's y over the TP axis

    def total_s(self, overlapped: bool) -> float:
        return max(self.fsdp_s, self.tp_s) if overlapped else self.fsdp_s + self.tp_s


def fsdp_tp_forward_comm(B: float, D: int, D_FF: int, N_FSDP: int, N_TP: int, W: float) -> AxisTimes:
    """FSDP axis: 6 (N_FSDP - 1) D D_FF / (N_FSDP N_TP W). TP axis: 4 (N_TP - 1) B D / (N_TP N_FSDP W)."""
    check_positive(N_FSDP=N_FSDP, N_TP=N_TP)
    return AxisTimes(all_gather_s(_weights_bytes(D, D_FF) / N_TP, N_FSDP, W),
                     all_reduce_s(FP16_BYTES * B * D / N_FSDP, N_TP, W))


def fsdp_tp_headroom(B: float, D_FF: int, C: float, W: float) -> tuple[float, float]:
    """(a, b) = (B W / C, 3 D_FF W / (2 C)): per forward, the FSDP axis is compute bound while
    N_FSDP - 1 <= a and the TP axis while N_TP - 1 <= b (each collective against 6 B D D_FF / (N C))."""
    check_positive(B=B, D_FF=D_FF, C=C, W=W)
    return B * W / C, 3 * D_FF * W / (2 * C)


@dataclass(frozen=True)
class MeshBound:
    """The largest N = N_FSDP N_TP whose forward stays compute bound, and the split that reaches it."""
    N: float
    N_FSDP: float
    N_TP: float


def fsdp_tp_max_devices_overlapped(B: float, D_FF: int, C: float, W: float) -> MeshBound:
    """N <= (1 + B W / C)(1 + 3 D_FF W / (2 C)): the two axes' conditions are independent, so each
    degree goes to its own limit."""
    a, b = fsdp_tp_headroom(B, D_FF, C, W)
    return MeshBound((1 + a) * (1 + b), 1 + a, 1 + b)


def fsdp_tp_max_devices_shared(B: float, D_FF: int, C: float, W: float) -> MeshBound:
    """The largest N when the two axes' collectives share the network and add up.

    With u = N_FSDP - 1, v = N_TP - 1 >= 0 the forward is compute bound while u / a + v / b <= 1.
    N = (1 + u)(1 + v) is largest on that line; along it N(u) = (1 + u)(1 + b - b u / a), a downward
    parabola with its top at 1 + u = a L / 2, 1 + v = b L / 2, L = 1 + 1 / a + 1 / b, where
    N = a b L^2 / 4 = (a b + a + b)^2 / (4 a b). When that top lies outside u, v >= 0, the best is
    the end of the line on the axis that still has room: all FSDP (N = 1 + a) or all TP (1 + b).
    For large a and b, N -> a b / 4, a quarter of the overlapped bound.
    """
    a, b = fsdp_tp_headroom(B, D_FF, C, W)
    spread = 1 + 1 / a + 1 / b
    fsdp, tp = a * spread / 2, b * spread / 2
    if fsdp < 1:
        return MeshBound(1 + b, 1.0, 1 + b)
    if tp < 1:
        return MeshBound(1 + a, 1 + a, 1.0)
    return MeshBound(fsdp * tp, fsdp, tp)
