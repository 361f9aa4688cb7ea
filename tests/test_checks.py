"""Argument checks refuse bad input with a message that names the argument and what it was given."""

import math

import pytest

from cs336_systems.checks import (
    check_choice,
    check_non_negative,
    check_non_negative_finite,
    check_positive,
    check_positive_finite,
    check_positive_int,
    is_finite,
    is_non_negative_finite,
    is_positive_finite,
    repeated,
)


@pytest.mark.parametrize("check, values, error, message", [
    (check_positive_int, dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
    (check_positive_int, dict(world_size=2.0), TypeError, "world_size must be an int, got float"),
    (check_positive_int, dict(world_size=True), TypeError, "world_size must be an int, got bool"),
    (check_positive, dict(latency_s=0.0), ValueError, "latency_s must be positive, got 0.0"),
    (check_positive, dict(latency_s=math.nan), ValueError, "latency_s must be positive, got nan"),
    (check_positive_finite, dict(size_mb=math.inf), ValueError, "size_mb must be positive and finite, got inf"),
    (check_positive_finite, dict(size_mb=-1), ValueError, "size_mb must be positive and finite, got -1"),
    (check_positive_finite, dict(size_mb="25"), TypeError, "size_mb must be a number, got str"),
    (check_positive_finite, dict(size_mb=True), TypeError, "size_mb must be a number, got bool"),
    (check_non_negative, dict(tokens=-1), ValueError, "tokens must be >= 0, got -1"),
    (check_non_negative, dict(tokens=math.nan), ValueError, "tokens must be >= 0, got nan"),
    (check_non_negative_finite, dict(block_bytes=math.inf), ValueError, "block_bytes must be >= 0 and finite, got inf"),
    (check_non_negative_finite, dict(block_bytes=-1.0), ValueError, "block_bytes must be >= 0 and finite, got -1.0"),
    (check_non_negative_finite, dict(block_bytes=None), TypeError, "block_bytes must be a number, got NoneType"),
])
def test_a_bad_value_is_refused_by_name(check, values, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        check(**values)


def test_every_value_is_checked_and_good_ones_pass():
    check_positive_int(batch_size=1, seq_len=2**20)
    check_positive(bandwidth_bytes_per_s=1e-9)
    check_positive_finite(bucket_size_mb=1, bandwidth_bytes_per_s=0.5)
    check_non_negative(tokens=0)
    check_non_negative_finite(block_bytes=0, boundary_bytes=2.5)
    with pytest.raises(ValueError, match="seq_len"):
        check_positive_int(batch_size=4, seq_len=0)


def test_an_unknown_choice_is_refused_with_the_choices_listed():
    check_choice("phase", "forward", ("forward", "backward"))
    with pytest.raises(ValueError, match=r"^unknown phase 'sideways'; choose one of forward, backward$"):
        check_choice("phase", "sideways", {"forward": 1, "backward": 2})


@pytest.mark.parametrize("value, finite, non_negative, positive", [
    (1.5, True, True, True),
    (0, True, True, False),
    (-2, True, False, False),
    (10**400, True, True, True),  # an int past a float's range is still a finite number
    (math.inf, False, False, False),
    (math.nan, False, False, False),
    (True, False, False, False),  # a bool is no number here
    ("3", False, False, False),
])
def test_the_number_predicates_judge_without_raising(value, finite, non_negative, positive):
    assert (is_finite(value), is_non_negative_finite(value), is_positive_finite(value)) == (finite, non_negative, positive)


def test_repeated_names_each_value_given_twice_once():
    assert repeated([16, 32, 16, 16, 8, 8]) == [8, 16] and repeated(("fp32", "bf16")) == []
