"""What the conformance suite observes of an implementation, in one process: the bytes its tensors hold
however they are kept alive, and the state tensors an optimizer holds however it nests them."""

from __future__ import annotations

import torch
from torch import nn

from cs336_systems.conformance.observe import LiveStorages, reachable_tensors, storage_bytes

FLOAT32_BYTES = 4


def test_live_storages_count_a_tensor_that_only_autograd_keeps():
    weight = torch.randn(64, 64, requires_grad=True)
    activation = torch.ones(1, 64, requires_grad=True)
    with LiveStorages() as storages:
        gathered = weight * 2  # a copy, as an all-gather makes
        output = (activation @ gathered).sum()  # autograd saves `gathered` for the activation's gradient
        del gathered
        assert storages.live_bytes() >= 64 * 64 * FLOAT32_BYTES
        output.backward()
        del output
        assert storages.live_bytes(excluding=[weight.grad, activation.grad]) == 0


def test_live_storages_count_a_storage_resized_to_nothing_as_freed():
    with LiveStorages() as storages:
        full = torch.empty(1000)
        full.untyped_storage().resize_(0)  # how torch's FSDP frees a gathered weight it keeps a handle on
        assert storages.live_bytes() == 0
        assert storages.live_bytes(excluding=[full]) == 0


def test_live_storages_track_the_peak_between_watch_and_stop():
    with LiveStorages() as storages:
        storages.watch_peak()
        start = storages.peak_bytes
        torch.zeros(256).add_(1)  # alive for a moment
        assert storages.stop_peak() - start >= 256 * FLOAT32_BYTES
    assert storages.live_bytes() == 0


def test_a_view_counts_the_whole_storage_it_keeps_alive():
    full = torch.zeros(100)
    assert storage_bytes([full[:10]]) == 100 * FLOAT32_BYTES
    assert storage_bytes([full[:10], full[50:]]) == 100 * FLOAT32_BYTES


class _Wrapper(torch.optim.Optimizer):
    """State one level down, in an inner optimizer held in a list: where a sharded optimizer may keep it."""

    def __init__(self, params):
        params = list(params)
        super().__init__(params, {})
        self.inner = [torch.optim.AdamW(params[:1])]

    def step(self, closure=None):
        return self.inner[0].step(closure)


def test_an_optimizer_s_state_is_found_however_deep_and_without_its_parameters():
    model = nn.Linear(8, 4)
    optimizer = _Wrapper(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    found = reachable_tensors(optimizer, excluding=params + [p.grad for p in params])
    # AdamW's two moments of the weight and its step count; no parameter, no gradient.
    assert sorted(t.numel() for t in found) == [1, 32, 32]


def test_live_storages_leave_out_views_of_tensors_made_before_them():
    older = torch.zeros(1000)
    with LiveStorages() as storages:
        view = older[:10].t()
        made_here = torch.tensor([1.0, 2.0])  # torch.tensor's own tensor counts
        assert storages.live_bytes() == made_here.nbytes
    del view
