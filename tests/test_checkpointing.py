"""Activation checkpointing: plans, the memory model and its optimum, and equivalence with no
checkpointing on the real model."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.distributed.checkpointing import (
    Checkpoint,
    CheckpointedStack,
    Sublayers,
    apply_checkpointing,
    blocks_of,
    checkpoint_chain,
    describe,
    every_k,
    every_sublayer,
    optimal_plan,
    plan_cost,
    remove_checkpointing,
    validate_plan,
)
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.accounting.activations import block_saved_bytes, sublayer_saved_bytes
from cs336_systems.profiling.memory import peak_memory_increase

LAYERS = 5
CONFIG = ModelConfig(d_model=32, d_ff=96, num_layers=LAYERS, num_heads=4, context_length=16, vocab_size=64)


def test_every_k_groups_consecutive_blocks():
    assert every_k(5, None) == (0, 1, 2, 3, 4)
    assert every_k(5, 2) == (Checkpoint((0, 1)), Checkpoint((2, 3)), Checkpoint((4,)))
    assert every_k(5, 9) == (Checkpoint((0, 1, 2, 3, 4)),)
    assert describe(every_k(8, 4)) == "[0-3] [4-7]"
    with pytest.raises(ValueError, match="k >= 1"):
        every_k(5, 0)


def test_plans_must_run_every_block_once_in_order():
    validate_plan((0, Checkpoint((1, Checkpoint((2,)))), 3), 4)
    for bad in [(0, 2, 1), (0, 1), (0, Checkpoint((1, 1)), 2)]:
        with pytest.raises(ValueError, match="once each, in order"):
            validate_plan(bad, 3)
    with pytest.raises(ValueError, match="at least one block"):
        Checkpoint(())


def test_plan_cost_by_hand():
    a, b = 10.0, 1.0
    # No checkpointing: every block keeps a; backward starts with all four held.
    assert plan_cost(every_k(4, None), a, b).peak_bytes == 40
    # Every block checkpointed: four inputs kept (4b); backward of the last group recomputes it and
    # holds a, whose input is that group's kept input: 3b + a = 13.
    cost = plan_cost(every_k(4, 1), a, b)
    assert (cost.peak_bytes, cost.kept_bytes, cost.recomputed_blocks) == (13, 4, 4)
    # Two groups of two: 2 inputs kept; inside the last, 2 plain blocks = 2a, one sharing the input: b + 2a.
    assert plan_cost(every_k(4, 2), a, b).peak_bytes == 21
    # A group inside a group: both hold the same input, counted once; block 1 recomputed twice.
    nested = (Checkpoint((Checkpoint((0,)), 1)),)
    assert plan_cost(nested, a, b).peak_bytes == 11 and plan_cost(nested, a, b).recomputed_blocks == 3


def _all_sequences(n: int, held: bool):
    """Every plan over n blocks (as sequences of item sizes, each a plain block or a group), shaped
    like the dynamic program's search space: a group never wraps its whole enclosing sequence."""
    if n == 0:
        yield ()
        return
    for rest in _all_sequences(n - 1, False):
        yield (("plain",),) + rest
    for m in range(1, n):
        for inner in _all_sequences(m, True):
            for rest in _all_sequences(n - m, False):
                yield (("group", inner),) + rest


def _build(sequence, first=0):
    items = []
    for item in sequence:
        if item[0] == "plain":
            items.append(first)
            first += 1
        else:
            inner = _build(item[1], first)
            items.append(Checkpoint(inner))
            first += len(blocks_of(inner))
    return tuple(items)


def _depth(items) -> int:
    return max((1 + _depth(i.items) if isinstance(i, Checkpoint) else 0 for i in items), default=0)


@pytest.mark.parametrize("a, b", [(10.0, 1.0), (3.0, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("levels", [1, 2, None])
def test_optimal_plan_beats_every_plan_found_by_brute_force(a, b, levels):
    for n in range(1, 6):
        plans = [_build(s) for s in _all_sequences(n, False)]
        allowed = [p for p in plans if levels is None or _depth(p) <= levels]
        best_peak = min(plan_cost(p, a, b).peak_bytes for p in allowed)
        plan, cost = optimal_plan(n, a, b, levels)
        validate_plan(plan, n)
        assert levels is None or _depth(plan) <= levels
        assert cost == plan_cost(plan, a, b)
        assert cost.peak_bytes == pytest.approx(best_peak)


def test_optimal_plan_asymptotics_for_48_blocks():
    a, b, layers = 28.0, 1.0, 48  # a block keeps 28x its input, as the xl model does
    single_best = min(plan_cost(every_k(layers, k), a, b).peak_bytes for k in range(1, layers + 1))
    peaks = [optimal_plan(layers, a, b, levels)[1].peak_bytes for levels in (1, 2, 3, 6)]
    assert peaks[0] <= single_best
    assert peaks == sorted(peaks, reverse=True)  # more recomputation levels never cost memory
    # No limit: the nested chain recomputing from the input, a + b, with L(L - 1)/2 recomputed blocks.
    _, unlimited = optimal_plan(layers, a, b)
    assert unlimited.peak_bytes == a + b and unlimited.recomputed_blocks == layers * (layers - 1) // 2
    # log2(L) levels: peak within a + b log2 L, each block recomputed at most log2 L times.
    levels = math.ceil(math.log2(layers))
    plan, cost = optimal_plan(layers, a, b, levels)
    assert cost.peak_bytes <= a + b * levels and cost.recomputed_blocks <= layers * levels


def test_optimal_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="cannot be below"):
        optimal_plan(4, block_bytes=1.0, boundary_bytes=2.0)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        optimal_plan(0, 2.0, 1.0)


@pytest.mark.parametrize("call, error, message", [
    (lambda: optimal_plan(4.5, 10.0, 1.0), TypeError, "num_layers must be an int"),
    (lambda: optimal_plan(4, -1.0, -2.0), ValueError, "block_bytes must be >= 0"),
    (lambda: optimal_plan(4, math.nan, 1.0), ValueError, "block_bytes must be >= 0 and finite"),
    (lambda: optimal_plan(4, 10.0, math.inf), ValueError, "boundary_bytes must be >= 0 and finite"),
    (lambda: optimal_plan(4, 10.0, 1.0, 1.5), ValueError, "max_recomputations must be an int"),
    (lambda: plan_cost((0, 0, 5), 10.0, 1.0), ValueError, "once each, in order"),
    (lambda: plan_cost((0, 1), math.nan, 1.0), ValueError, "block_bytes must be >= 0 and finite"),
    (lambda: every_k(-3, 2), ValueError, "num_layers must be >= 1"),
    (lambda: every_k(4, 2.0), TypeError, "needs an int k"),
    (lambda: every_sublayer(0), ValueError, "num_layers must be >= 1"),
])
def test_plans_and_their_costs_refuse_sizes_that_are_no_such_thing(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _loss_and_grads(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = TransformerLM(CONFIG, attention="naive").double()
    inputs, targets = torch.randint(0, CONFIG.vocab_size, (2, 2, CONFIG.context_length))
    return model, inputs, targets, _loss_and_grads(model, inputs, targets)


PLANS = [every_k(LAYERS, 1), every_k(LAYERS, 2), every_k(LAYERS, 3), every_k(LAYERS, LAYERS),
         optimal_plan(LAYERS, 28.0, 1.0, 1)[0], optimal_plan(LAYERS, 28.0, 1.0, 2)[0], optimal_plan(LAYERS, 28.0, 1.0)[0],
         every_sublayer(LAYERS), (0, Checkpoint((1, Sublayers(2))), 3, Sublayers(4))]
# Prices split blocks in the plan tests: a_attn + a_ffn = 28, each at least its input.
SUBLAYERS = (20.0, 8.0)


@pytest.mark.parametrize("plan", PLANS, ids=describe)
def test_checkpointing_gives_bit_identical_loss_and_gradients(reference, plan):
    model, inputs, targets, (loss, grads) = reference
    checkpointed = apply_checkpointing(copy.deepcopy(model), plan)
    assert list(checkpointed.state_dict()) == list(model.state_dict())
    starts = []
    for block in checkpointed.layers.blocks():  # a block's first norm runs whether the block is split or not
        block.ln1.register_forward_pre_hook(lambda module, args: starts.append(module))
    got_loss, got_grads = _loss_and_grads(checkpointed, inputs, targets)
    assert torch.equal(got_loss, loss)
    assert all(torch.equal(g, r) for g, r in zip(got_grads, grads))
    # Every block runs once in forward, plus once per recomputation the plan implies.
    assert len(starts) == LAYERS + plan_cost(plan, 28.0, 1.0, SUBLAYERS).recomputed_blocks


def test_the_chain_gives_the_same_gradients_and_recomputes_as_the_unlimited_optimum(reference):
    model, inputs, targets, (loss, grads) = reference
    chained = copy.deepcopy(model)
    blocks = list(chained.layers)
    forwards = []
    for block in blocks:
        block.register_forward_pre_hook(lambda module, args: forwards.append(module))

    class Chain(torch.nn.Module):  # the model's loop over layers runs the whole chain as one stage
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(blocks)

        def __iter__(self):
            yield lambda x: checkpoint_chain(list(self.blocks), x)

    chained.layers = Chain()
    got_loss, got_grads = _loss_and_grads(chained, inputs, targets)
    assert torch.equal(got_loss, loss) and all(torch.equal(g, r) for g, r in zip(got_grads, grads))
    _, optimum = optimal_plan(LAYERS, 28.0, 1.0)
    assert len(forwards) == LAYERS + optimum.recomputed_blocks == LAYERS + LAYERS * (LAYERS - 1) // 2


def test_split_blocks_keep_two_inputs_and_peak_at_the_larger_sublayer():
    a, b = 28.0, 1.0
    # Four split blocks: 8 inputs kept. Backward of the last: 6b kept before it, then b + a_ffn = 9 while its
    # feed-forward sublayer is recomputed, a_attn = 20 while its attention sublayer is: 6 + 20.
    cost = plan_cost(every_sublayer(4), a, b, SUBLAYERS)
    assert (cost.peak_bytes, cost.kept_bytes, cost.recomputed_blocks) == (26, 8, 4)
    assert describe(every_sublayer(3)) == "{0} {1} {2}" and blocks_of(every_sublayer(3)) == [0, 1, 2]
    # Inside a group, the first split block shares the group's input.
    assert plan_cost((Checkpoint((Sublayers(0),)),), a, b, SUBLAYERS).peak_bytes == 1 + 20 - 1
    with pytest.raises(ValueError, match="needs sublayer_bytes"):
        plan_cost(every_sublayer(2), a, b)
    with pytest.raises(ValueError, match="add up to block_bytes"):
        plan_cost(every_sublayer(2), a, b, (20.0, 7.0))


@pytest.mark.parametrize("precision, attention", [("fp32", "naive"), ("bf16", "naive"), ("bf16", "sdpa")])
def test_sublayer_bytes_split_the_block_and_each_keeps_its_input(precision, attention):
    config = ModelConfig.for_size("xl", 2048)
    attention_bytes, ffn_bytes = sublayer_saved_bytes(config, 4, 2048, precision, attention)
    assert attention_bytes + ffn_bytes == sum(block_saved_bytes(config, 4, 2048, precision, attention).values())
    assert min(attention_bytes, ffn_bytes) > 4 * 2048 * config.d_model * 4


def test_apply_and_remove_keep_the_same_blocks(reference):
    model = copy.deepcopy(reference[0])
    blocks = list(model.layers)
    apply_checkpointing(model, every_k(LAYERS, 2))
    apply_checkpointing(model, every_k(LAYERS, 1))  # re-planning keeps the blocks
    assert isinstance(model.layers, CheckpointedStack) and model.layers.blocks() == blocks
    assert len(model.layers) == LAYERS and model.layers[3] is blocks[3]
    remove_checkpointing(model)
    assert type(model.layers) is torch.nn.ModuleList and list(model.layers) == blocks
    with pytest.raises(ValueError, match="once each"):
        apply_checkpointing(model, every_k(LAYERS - 1, 1))
    with pytest.raises(TypeError, match="no .layers"):
        apply_checkpointing(torch.nn.Linear(2, 2), every_k(2, 1))


def test_measured_peaks_differ_between_plans_as_the_model_predicts():
    """On CPU, torch.profiler's memory records give the real peak of each plan; beyond a constant
    (the head and the loss, outside the plan), the model predicts it to within a tenth of a block."""
    from cs336_systems.accounting.activations import block_saved_bytes, residual_stream_bytes

    torch.manual_seed(0)
    batch, seq = 4, 32
    config = ModelConfig(d_model=64, d_ff=256, num_layers=6, num_heads=4, context_length=seq, vocab_size=64)
    model = TransformerLM(config, attention="sdpa")
    inputs, targets = torch.randint(0, config.vocab_size, (2, batch, seq))
    a = sum(block_saved_bytes(config, batch, seq, "fp32", "sdpa", "cpu").values())
    b = residual_stream_bytes(config, batch, seq)

    def step():
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()

    step()  # gradients allocated once; zeroed in place below, so peaks hold no gradients
    sublayers = sublayer_saved_bytes(config, batch, seq, "fp32", "sdpa", "cpu")
    offsets = {}
    for plan in [every_k(6, None), every_k(6, 1), every_k(6, 3), optimal_plan(6, a, b)[0], every_sublayer(6)]:
        apply_checkpointing(model, plan)
        model.zero_grad(set_to_none=False)
        peak, _ = peak_memory_increase(step, "cpu")
        offsets[describe(plan)] = peak - plan_cost(plan, a, b, sublayers).peak_bytes
    assert max(offsets.values()) - min(offsets.values()) < 0.1 * a, offsets


def test_every_k_sweep_includes_the_sqrt_rule_neighbourhood():
    # k = sqrt(L b / a) minimises b L / k + a k; the model's best every-k sits next to it.
    a, b, layers = 4.0, 1.0, 48
    best_k = min(range(1, layers + 1), key=lambda k: plan_cost(every_k(layers, k), a, b).peak_bytes)
    assert abs(best_k - math.sqrt(layers * b / a)) <= 1.5


@pytest.mark.parametrize("k", [1, 2, 4])
def test_every_k_plans_recompute_each_block_once(k):
    assert plan_cost(every_k(12, k), 5.0, 1.0).recomputed_blocks == 12
    assert blocks_of(every_k(12, k)) == list(range(12))
