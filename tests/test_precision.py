"""The precision table: what each name means for tensors, autocast and memory."""

import pytest
import torch

from cs336_systems.benchmarks.harness import autocast
from cs336_systems.precision import PRECISIONS, Precision, check_precision


@pytest.mark.parametrize("name", PRECISIONS)
def test_a_tensor_made_in_a_precision_takes_its_bytes_per_element(name):
    spec = Precision.named(name)
    tensor = torch.zeros(3, dtype=spec.dtype)
    assert tensor.element_size() == spec.bytes_per_element and tensor.nbytes == 3 * spec.bytes_per_element


@pytest.mark.parametrize("name", PRECISIONS)
def test_a_matmul_under_a_precisions_autocast_runs_in_its_autocast_dtype(name):
    a = torch.ones(4, 4)
    with autocast(name, "cpu"):
        product = a @ a
    assert product.dtype == (Precision.named(name).autocast_dtype or torch.float32)


def test_only_the_low_precisions_run_under_autocast():
    assert [name for name, spec in PRECISIONS.items() if spec.autocast_dtype is not None] == ["bf16", "fp16"]


def test_an_unknown_precision_is_refused_with_the_known_ones_listed():
    with pytest.raises(ValueError, match=r"^unknown precision 'fp8'; choose one of fp32, bf16, fp16$"):
        Precision.named("fp8")
    with pytest.raises(ValueError, match="unknown precision 'tf32'"):
        check_precision("tf32")
    with pytest.raises(ValueError, match="unknown precision 'fp64'"):
        autocast("fp64", "cpu")
