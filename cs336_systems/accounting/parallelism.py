"""Memory and compute-vs-communication limits of DP, FSDP, TP and FSDP+TP for a stack of MLP blocks.

The model (the course's XXL simplification, and the scaling book's, "How to Scale Your Model", part 5):
`num_blocks` blocks, each two bias-free linears In[B, D] -> Tmp[B, F] -> Out[B, D] with D = d_model,
F = d_ff and B the number of tokens in the batch; no attention, embeddings or nonlinearity.

Notation. X devices shard the batch (data parallel or FSDP), Y devices shard F (tensor parallel),
N = X Y. C is a device's FLOP/s. W is the bandwidth of one mesh axis, counting both directions (the
scaling book's W_ici); a collective over M_X (or M_Y) mesh axes has M_X W. e is the bytes per
element that collectives move (2 for bf16).

FLOPs. A matmul [m, k] x [k, n] costs 2mkn FLOPs. Forward: two matmuls of 2BDF, split over N
devices, 4BDF / (N C). Backward: each matmul needs the gradient of its input and of its weight,
twice the forward, 8BDF / (N C).

Communication per block (shardings as the scaling book writes them):

    DP       In[B_X, D]   . W_in[D, F]      . W_out[F, D]      -> Out[B_X, D]
    FSDP     In[B_X, D]   . W_in[D_X, F]    . W_out[F, D_X]    -> Out[B_X, D]
    TP       In[B, D_Y]   . W_in[D, F_Y]    . W_out[F_Y, D]    -> Out[B, D_Y]
    FSDP+TP  In[B_X, D_Y] . W_in[D_X, F_Y]  . W_out[F_Y, D_X]  -> Out[B_X, D_Y]

- weights (FSDP, over X): forward all-gathers W_in[D, F_Y] and W_out[F_Y, D], e D F / Y bytes each;
  backward gathers them again (they were freed after use) and reduce-scatters both gradients. DP
  keeps whole weights and instead all-reduces both gradients in backward; its forward is free.
- activations (TP, over Y): forward all-gathers In[B_X, D] before W_in and reduce-scatters the
  partial sums Out[B_X, D]{U_Y} after W_out, e B D / X bytes each; backward all-gathers dOut and
  reduce-scatters dIn, the same bytes (the gathered In is kept from forward).

Collective times come from `communication` (ring, bandwidth terms only: these arrays are megabytes
to gigabytes, far above the latency-bound sizes). By default they use the scaling book's large-ring
limit, where the ring's (N - 1) / N factor is taken as 1 (an all-gather of V bytes takes V / W);
`exact_ring=True` keeps the factor. A group of one device communicates nothing.

Compute bound. Collectives are assumed to overlap with the matmuls (FSDP gathers prefetched a layer
ahead; TP collectives split into chunks that overlap with the matmul's pieces, as collective matmuls
do) but to run one after another, so a block is compute bound when compute_s >= weight_comm_s +
activation_comm_s (the scaling book's condition). Every term is affine in
B: the weight collectives do not depend on it, the activation collectives and FLOPs grow with it.
For FSDP+TP forward in the book's limit, with b = B / N tokens per device and alpha = C / W:

    2 e D F / (Y M_X W) + 2 e b N D / (X M_Y W) <= 4 b N D F / (N C)
    <=>  b >= (e/2) F / (Y M_X)  /  (F / alpha - (e/2) Y / M_Y)

(never, when F / alpha <= (e/2) Y / M_Y: TP alone is then communication bound). Minimising over the
split of N devices, at Y* = F M_Y / (e alpha), gives the scaling book's floor 4 (e alpha / 2)^2 /
(F M_X M_Y). DP and FSDP reduce to b >= (e/2) alpha / M_X; pure TP is compute bound at any batch
when F >= (e/2) alpha Y / M_Y and at none otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.accounting.communication import COLLECTIVES
from cs336_systems.checks import check_choice, check_non_negative, check_positive, check_positive_int

BF16_BYTES = 2
FP32_BYTES = 4
ADAM_MOMENTS = 2  # first and second moment per parameter

# TPU v5p figures as the course quotes them from the scaling book: bf16 FLOP/s per chip, ICI
# bandwidth of one mesh axis counting both directions (9e10 bytes/s each way), HBM per chip.
TPU_V5P_FLOPS_PER_S = 4.6e14
TPU_V5P_ICI_BYTES_PER_S = 2 * 9e10
TPU_V5P_MEMORY_BYTES = 95e9
# The scaling book: "each hop over an ICI link has some intrinsic overhead ... typically around 1us".
ICI_HOP_LATENCY_S = 1e-6

STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
# A layer's passes, each with its own communication and matmuls.
PASSES = ("forward", "backward")
_MATMULS_PER_LINEAR = {"forward": 1, "backward": 2}  # backward: input gradient and weight gradient


@dataclass(frozen=True)
class FeedForwardStack:
    """`num_blocks` blocks of Linear(d_model -> d_ff) then Linear(d_ff -> d_model), no biases."""

    d_model: int
    d_ff: int
    num_blocks: int

    def __post_init__(self):
        check_positive_int(d_model=self.d_model, d_ff=self.d_ff, num_blocks=self.num_blocks)

    @property
    def num_params(self) -> int:
        return 2 * self.d_model * self.d_ff * self.num_blocks


XXL = FeedForwardStack(d_model=16384, d_ff=53248, num_blocks=126)


# ----------------------------------------------------------------------------------------- memory

@dataclass(frozen=True)
class TrainingStateBytes:
    master_weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.master_weights + self.gradients + self.optimizer


def training_state_bytes(model: FeedForwardStack, weight_bytes: int = FP32_BYTES,
                         gradient_bytes: int = FP32_BYTES, optimizer_moments: int = ADAM_MOMENTS,
                         moment_bytes: int = FP32_BYTES) -> TrainingStateBytes:
    """Master weights, accumulated gradients and Adam's moments: one value each per parameter."""
    check_positive_int(weight_bytes=weight_bytes, gradient_bytes=gradient_bytes, moment_bytes=moment_bytes)
    check_non_negative(optimizer_moments=optimizer_moments)
    p = model.num_params
    return TrainingStateBytes(p * weight_bytes, p * gradient_bytes, p * optimizer_moments * moment_bytes)


def saved_activation_bytes_per_token(model: FeedForwardStack, activation_bytes: int = BF16_BYTES) -> int:
    """Bytes one token leaves for backward: each linear keeps its input for its weight gradient.

    dW_in = In^T dTmp needs In (d_model values) and dW_out = Tmp^T dOut needs Tmp (d_ff values). A
    block's output is the next block's input, saved once, as that block's In.
    """
    check_positive_int(activation_bytes=activation_bytes)
    return model.num_blocks * (model.d_model + model.d_ff) * activation_bytes


def saved_activation_bytes(model: FeedForwardStack, tokens: int, activation_bytes: int = BF16_BYTES) -> int:
    check_non_negative(tokens=tokens)
    return tokens * saved_activation_bytes_per_token(model, activation_bytes)


def saved_activation_bytes_per_device(model: FeedForwardStack, tokens: float, data_devices: int,
                                      tensor_devices: int, activation_bytes: int = BF16_BYTES) -> float:
    """Bytes one device of an X x Y FSDP+TP mesh saves for backward: L e (B / X) (D + F / Y).

    Its B / X tokens' In[B_X, D], gathered over Y before W_in and kept for backward (as `layer_times`
    assumes), and its slice Tmp[B_X, F_Y] of the hidden activations.
    """
    check_positive_int(data_devices=data_devices, tensor_devices=tensor_devices, activation_bytes=activation_bytes)
    check_non_negative(tokens=tokens)
    per_token_per_block = activation_bytes * (model.d_model + model.d_ff / tensor_devices)
    return model.num_blocks * per_token_per_block * tokens / data_devices


def fsdp_bytes_per_device(state_bytes: float, activation_bytes: float, num_devices: int) -> float:
    """state / N + A / (2N) + A / 2: the state and half the activations sharded, half replicated."""
    check_positive_int(num_devices=num_devices)
    check_non_negative(state_bytes=state_bytes, activation_bytes=activation_bytes)
    return (state_bytes + activation_bytes / 2) / num_devices + activation_bytes / 2


def min_fsdp_devices(state_bytes: float, activation_bytes: float, device_memory_bytes: float) -> int:
    """Smallest N with `fsdp_bytes_per_device` < device memory: N > (S + A/2) / (M - A/2)."""
    check_non_negative(state_bytes=state_bytes, activation_bytes=activation_bytes)
    check_positive(device_memory_bytes=device_memory_bytes)
    headroom = device_memory_bytes - activation_bytes / 2
    if headroom <= 0:
        raise ValueError(f"the unsharded half of the activations ({activation_bytes / 2:.4g} bytes) alone does "
                         f"not fit in {device_memory_bytes:.4g} bytes; no number of FSDP devices helps")
    return math.floor((state_bytes + activation_bytes / 2) / headroom) + 1


def max_tokens_for_fsdp(model: FeedForwardStack, device_memory_bytes: float,
                        activation_bytes: int = BF16_BYTES) -> float:
    """The token count whose unsharded half of the activations fills a device: 2 M / bytes per token.

    Fewer tokens than this fit with enough FSDP devices; this many or more fit with none.
    """
    check_positive(device_memory_bytes=device_memory_bytes)
    return 2 * device_memory_bytes / saved_activation_bytes_per_token(model, activation_bytes)


# ------------------------------------------------------------------------- compute vs communication

@dataclass(frozen=True)
class LayerTimes:
    """One block's matmul time and the time of its collectives on one device, in seconds."""

    compute_s: float
    weight_comm_s: float  # FSDP gathers and gradient reduce-scatters, or DP all-reduces: data axis
    activation_comm_s: float  # TP gathers and reduce-scatters of activations: tensor axis

    @property
    def comm_s(self) -> float:
        return self.weight_comm_s + self.activation_comm_s

    @property
    def compute_bound(self) -> bool:
        return self.compute_s >= self.comm_s


def _collective_s(collective: str, array_bytes: float, num_devices: int, bandwidth_bytes_per_s: float,
                  exact_ring: bool) -> float:
    if num_devices == 1:
        return 0.0
    ring_s = COLLECTIVES[collective](array_bytes, num_devices, bandwidth_bytes_per_s)
    # The scaling book's large-ring limit: the ring moves (N - 1) / N of the array; take that as 1.
    return ring_s if exact_ring else ring_s * num_devices / (num_devices - 1)


def _check_mesh(strategy: str, data_devices: int, tensor_devices: int) -> None:
    check_choice("strategy", strategy, STRATEGIES)
    check_positive_int(data_devices=data_devices, tensor_devices=tensor_devices)
    if strategy in ("dp", "fsdp") and tensor_devices != 1:
        raise ValueError(f"{strategy} shards only the batch: tensor_devices must be 1, got {tensor_devices}")
    if strategy == "tp" and data_devices != 1:
        raise ValueError(f"tp shards only d_ff: data_devices must be 1, got {data_devices}")


def layer_times(strategy: str, phase: str, tokens: float, d_model: int, d_ff: int, data_devices: int,
                tensor_devices: int, flops_per_s: float, bandwidth_bytes_per_s: float, data_axes: float = 1,
                tensor_axes: float = 1, comm_bytes_per_element: int = BF16_BYTES,
                exact_ring: bool = False) -> LayerTimes:
    """Compute and communication time of one block on one device (see the module docstring).

    `tokens` is the global batch B; `data_devices` X and `tensor_devices` Y; `data_axes` M_X and
    `tensor_axes` M_Y are how many mesh axes (each of `bandwidth_bytes_per_s`) each collective uses.
    """
    _check_mesh(strategy, data_devices, tensor_devices)
    check_choice("phase", phase, PASSES)
    check_positive_int(d_model=d_model, d_ff=d_ff, comm_bytes_per_element=comm_bytes_per_element)
    check_non_negative(tokens=tokens)
    check_positive(flops_per_s=flops_per_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                    data_axes=data_axes, tensor_axes=tensor_axes)
    x, y = data_devices, tensor_devices
    data_bandwidth = bandwidth_bytes_per_s * data_axes
    tensor_bandwidth = bandwidth_bytes_per_s * tensor_axes

    matmul_flops = 2 * tokens * d_model * d_ff  # one linear over the whole batch
    compute_s = 2 * _MATMULS_PER_LINEAR[phase] * matmul_flops / (x * y * flops_per_s)

    weight_bytes = comm_bytes_per_element * d_model * d_ff / y  # W_in[D, F_Y] or W_out[F_Y, D], gathered
    if strategy == "dp":
        one_weight_s = (0.0 if phase == "forward"
                        else _collective_s("all_reduce", weight_bytes, x, data_bandwidth, exact_ring))
    else:
        one_weight_s = _collective_s("all_gather", weight_bytes, x, data_bandwidth, exact_ring)
        if phase == "backward":
            one_weight_s += _collective_s("reduce_scatter", weight_bytes, x, data_bandwidth, exact_ring)
    weight_comm_s = 2 * one_weight_s  # W_in and W_out

    activation_bytes = comm_bytes_per_element * tokens * d_model / x  # In[B_X, D] (dOut in backward)
    activation_comm_s = (_collective_s("all_gather", activation_bytes, y, tensor_bandwidth, exact_ring)
                         + _collective_s("reduce_scatter", activation_bytes, y, tensor_bandwidth, exact_ring))
    return LayerTimes(compute_s, weight_comm_s, activation_comm_s)


def min_tokens_per_device(strategy: str, phase: str, d_model: int, d_ff: int, data_devices: int,
                          tensor_devices: int, flops_per_s: float, bandwidth_bytes_per_s: float,
                          data_axes: float = 1, tensor_axes: float = 1, comm_bytes_per_element: int = BF16_BYTES,
                          exact_ring: bool = False) -> float:
    """The smallest B / N at which a block is compute bound in `phase`: 0.0 when any batch is, inf
    when none is.

    Weights move once per block whatever the batch, while FLOPs and activation traffic are
    proportional to it: compute = a B and comm = c0 + c1 B, so compute >= comm <=> B (a - c1) >= c0.
    One evaluation at B = 1 gives a, c0 and c1 (`LayerTimes` keeps the two kinds of traffic apart).
    """
    one = layer_times(strategy, phase, 1.0, d_model, d_ff, data_devices, tensor_devices, flops_per_s,
                      bandwidth_bytes_per_s, data_axes, tensor_axes, comm_bytes_per_element, exact_ring)
    fixed_comm_s = one.weight_comm_s
    comm_per_token_s = one.activation_comm_s
    compute_per_token_s = one.compute_s
    if compute_per_token_s < comm_per_token_s or (compute_per_token_s == comm_per_token_s and fixed_comm_s > 0):
        return math.inf
    if fixed_comm_s == 0:
        return 0.0
    return fixed_comm_s / (compute_per_token_s - comm_per_token_s) / (data_devices * tensor_devices)


def network_intensity(flops_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """alpha = C / W, FLOPs a device does in the time one byte crosses a mesh axis (v5p ICI: 2,556)."""
    check_positive(flops_per_s=flops_per_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return flops_per_s / bandwidth_bytes_per_s


def fsdp_tp_best_tensor_devices(d_ff: int, flops_per_s: float, bandwidth_bytes_per_s: float,
                                tensor_axes: float = 1, comm_bytes_per_element: int = BF16_BYTES) -> float:
    """Y* = F M_Y / (e alpha): the (real) TP degree that minimises FSDP+TP's forward threshold."""
    check_positive_int(d_ff=d_ff, comm_bytes_per_element=comm_bytes_per_element)
    check_positive(tensor_axes=tensor_axes)
    return d_ff * tensor_axes / (comm_bytes_per_element * network_intensity(flops_per_s, bandwidth_bytes_per_s))


def fsdp_tp_min_tokens_lower_bound(d_ff: int, flops_per_s: float, bandwidth_bytes_per_s: float,
                                   data_axes: float = 1, tensor_axes: float = 1,
                                   comm_bytes_per_element: int = BF16_BYTES) -> float:
    """4 (e alpha / 2)^2 / (F M_X M_Y): no split of the devices into X x Y gets below this B / N."""
    check_positive_int(d_ff=d_ff, comm_bytes_per_element=comm_bytes_per_element)
    check_positive(data_axes=data_axes, tensor_axes=tensor_axes)
    alpha = comm_bytes_per_element / 2 * network_intensity(flops_per_s, bandwidth_bytes_per_s)
    return 4 * alpha**2 / (d_ff * data_axes * tensor_axes)


def pipeline_bubble_fraction(stages: int, microbatches: int) -> float:
    """(P - 1) / (m + P - 1): the idle share of a GPipe or 1F1B schedule with P stages and m microbatches.

    Each stage works m slots of the m + P - 1 the schedule lasts (it waits P - 1 slots to fill or drain).
    """
    check_positive_int(stages=stages, microbatches=microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_send_to_compute_ratio(d_ff: int, num_blocks: int, stages: int, flops_per_s: float,
                                   bandwidth_bytes_per_s: float, comm_bytes_per_element: int = BF16_BYTES) -> float:
    """Time a pipeline stage spends sending its output over its forward compute time: e alpha P / (4 F L).

    A stage of L / P blocks, TP over Y devices, does 4 b D F (L / P) / (Y C) seconds of matmuls on a
    microbatch of b tokens and each device sends its e b D / Y bytes of Out[b, D_Y] to the next stage
    in e b D / (Y W): neither the microbatch nor Y changes the ratio.
    """
    check_positive_int(d_ff=d_ff, num_blocks=num_blocks, stages=stages, comm_bytes_per_element=comm_bytes_per_element)
    if stages > num_blocks:
        raise ValueError(f"{stages} pipeline stages for {num_blocks} blocks: a stage needs at least one block")
    alpha = network_intensity(flops_per_s, bandwidth_bytes_per_s)
    return comm_bytes_per_element * alpha * stages / (4 * d_ff * num_blocks)
