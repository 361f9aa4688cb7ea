"""FlashAttention-2 conformance: the course's two autograd Functions (get_flashattention_autograd_function_pytorch
and ..._triton), reached through the adapters under test, against a float64 reference (attention_reference.py
says how errors are judged), and what the Triton Function promises beyond its numbers.

Drawn inputs (hypothesis) and named cases cover 3-D and 4-D inputs, n_queries != n_keys, lengths that are no
multiple of any tile, head dims from 16 to 128 (80 among them), causal and not, the forward and the backward,
fp32, fp16 and bf16, contiguous, transposed and sliced views, scores of large magnitude, and the saved
logsumexp. On a CPU the Triton Function runs in Triton's interpreter on short sequences, in fp32 and fp16 (the
interpreter's bf16 dot is wrong, so bf16 through Triton runs on a GPU only), and the PyTorch Function now and
then meets a few thousand queries or keys; on a GPU lengths go up to a few thousand. The Triton Function must
launch Triton kernels in its forward and its backward and do no attention in torch ops, and on a GPU
compute-sanitizer must find no memory error in its launches.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs336_systems.conformance.attention_reference import LAYOUTS
from cs336_systems.conformance.flash_cases import Case, ConformanceFailure, check_function, results_of
from cs336_systems.conformance.launches import recorded, torch_attention

PYTORCH = "get_flashattention_autograd_function_pytorch"
TRITON = "get_flashattention_autograd_function_triton"
LABELS = {PYTORCH: "the PyTorch Function", TRITON: "the Triton Function"}
FUNCTIONS = [pytest.param(PYTORCH, marks=pytest.mark.adapters(PYTORCH), id="pytorch"),
             pytest.param(TRITON, marks=pytest.mark.adapters(TRITON), id="triton")]
INTERPRETER_BF16 = "bf16 through Triton runs on a GPU only: Triton's interpreter computes bf16 dots wrongly"

# The Triton interpreter turns loop bounds into ints through a NumPy conversion that NumPy deprecates, and it
# evaluates the lanes a mask leaves out too, where exp may overflow harmlessly: its warnings say nothing about
# the implementation under test (an overflow that reaches a result fails the test as a NaN or an infinity).
pytestmark = [pytest.mark.flash,
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def _function(adapters, name: str) -> type:
    return adapters.function(name)()


def _runs_here(name: str, dtype: torch.dtype, on_gpu: bool) -> bool:
    return on_gpu or not (name == TRITON and dtype == torch.bfloat16)


# ------------------------------------------------------------------------------------------- drawn inputs

# Examples per Function and test: on a CPU the interpreter runs a Triton program at a time in Python, so the
# sequences are short and the examples few; a GPU draws more, each of which may compile kernels (seconds).
CPU_EXAMPLES = 10
GPU_EXAMPLES = 25
# Sequence lengths drawn: up to a few tiles on a CPU (the interpreter), up to a few thousand on a GPU.
CPU_MAX_LENGTH = {PYTORCH: 150, TRITON: 70}
GPU_MAX_LENGTH = 3000
# On a CPU the PyTorch Function also meets a few thousand, in about one example in LONG_ONE_IN, for queries or
# for keys (the other length short): one such example costs a few seconds, both lengths long a minute or more.
# The Triton interpreter stays at CPU_MAX_LENGTH: a program at a time in Python takes minutes over that.
CPU_LONG_LENGTH = {PYTORCH: 3000}
LONG_ONE_IN = 8
HEAD_DIMS = (16, 24, 32, 40, 64, 80, 96, 128)
CPU_HEAD_DIMS = (16, 24, 32, 64, 80, 128)
# Scores' standard deviation: 1 is that of unit-normal q and k; larger spreads make the softmax peaked, where a
# wrong scale or mask shows most. LARGE_SCORE_SPREAD, as the large_scores named cases, puts the largest scores
# past 88.7, where exp overflows fp32, so that only a softmax that subtracts its running maximum stays finite.
# It is drawn on sequences of up to LARGE_SCORES_MAX_LENGTH (60 CPU draws in every dtype and head dim passed for
# both correct PyTorch Functions). Over thousands of keys correct PyTorch Functions exceeded the elementwise bound
# on o and dV until it allowed for the rounding of the exponents (attention_reference.EXPONENT_ROUNDINGS; since
# then, three such cases passed on a CPU), and no GPU has run large scores over long sequences: the cap stays.
LARGE_SCORE_SPREAD = 60.0
SCORE_SPREADS = (1.0, 2.0, 4.0, LARGE_SCORE_SPREAD)
LARGE_SCORES_MAX_LENGTH = 150


def _lengths(draw, name: str, on_gpu: bool, score_spread: float) -> tuple[int, int]:
    """n_queries and n_keys, equal or not; on a CPU, for a Function in CPU_LONG_LENGTH, now and then one of
    them long."""
    longest = GPU_MAX_LENGTH if on_gpu else CPU_MAX_LENGTH[name]
    if score_spread == LARGE_SCORE_SPREAD:
        longest = min(longest, LARGE_SCORES_MAX_LENGTH)
    elif not on_gpu and name in CPU_LONG_LENGTH and draw(st.integers(1, LONG_ONE_IN), label="long") == LONG_ONE_IN:
        long = draw(st.integers(longest + 1, CPU_LONG_LENGTH[name]), label="long length")
        short = draw(st.integers(1, longest), label="short length")
        return (long, short) if draw(st.booleans(), label="long queries") else (short, long)
    n_queries = draw(st.integers(1, longest), label="n_queries")
    return n_queries, draw(st.one_of(st.just(n_queries), st.integers(1, longest)), label="n_keys")


@st.composite
def cases(draw, name: str, on_gpu: bool) -> Case:
    lead = draw(st.sampled_from([(2,), (3,), (2, 2), (1, 3)] if not on_gpu else [(2,), (4,), (2, 4), (1, 8)]),
                label="leading dims")
    score_spread = draw(st.sampled_from(SCORE_SPREADS), label="score spread")
    n_queries, n_keys = _lengths(draw, name, on_gpu, score_spread)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    dtype = draw(st.sampled_from([t for t in dtypes if _runs_here(name, t, on_gpu)]), label="dtype")
    return Case(lead, n_queries, n_keys, draw(st.sampled_from(HEAD_DIMS if on_gpu else CPU_HEAD_DIMS), label="d"),
                dtype, draw(st.booleans(), label="is_causal"),
                tuple(draw(st.sampled_from(LAYOUTS), label=f"{x} layout") for x in "qkv"),
                score_spread, draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_drawn_inputs_match_the_float64_reference_forward_and_backward(name, adapters, run_settings, device):
    function = _function(adapters, name)

    # Settings made here, not at import: a run's hypothesis profile (--hypothesis-profile) applies to them.
    @given(case=cases(name, run_settings.on_gpu))
    @settings(max_examples=GPU_EXAMPLES if run_settings.on_gpu else CPU_EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    def check(case):
        check_function(function, case, device, LABELS[name])

    check()


# -------------------------------------------------------------------------------------------- named cases

def named_cases(on_gpu: bool) -> dict[str, Case]:
    """Cases that each put one part of the contract to the test, at CPU or GPU sizes: lengths that are no
    multiple of 16, 32, 64 or 128 (a tile's usual sizes), n_queries != n_keys both ways, every input's layout,
    each dtype, head dims that are no power of two, and scores past exp's range."""

    def length(cpu: int, gpu: int) -> int:
        return gpu if on_gpu else cpu

    n_q, n_k = length(45, 1000), length(70, 2100)
    fp32, fp16, bf16 = torch.float32, torch.float16, torch.bfloat16
    base = Case((2, 3), n_q, n_k, 32, fp32, True)
    cases = {
        "causal_fewer_queries_than_keys": base,
        "causal_more_queries_than_keys": dataclasses.replace(base, n_queries=n_k, n_keys=n_q),
        "full_fewer_queries_than_keys": dataclasses.replace(base, is_causal=False),
        "causal_one_query_one_key": Case((3,), 1, 1, 16, fp32, True),
        "full_one_query": Case((3,), 1, length(70, 1100), 16, fp32, False),
        "causal_tails_past_every_tile_size": Case((2,), length(130, 1100), length(130, 1100), 16, fp32, True),
        "full_tails_past_every_tile_size": Case((2,), length(130, 1100), length(130, 1100), 16, fp32, False),
        "3d_inputs": Case((3,), n_q, n_k, 32, fp32, True),
    }
    for head_dim in (16, 24, 80, 128):
        cases[f"head_dim_{head_dim}"] = dataclasses.replace(base, head_dim=head_dim)
    # One input at a time in each layout, 3-D (where merging the leading dims leaves every view a view), and all
    # three with their heads transposed, 4-D, as a model's attention passes them.
    for i, name in enumerate("qkv"):
        for layout in ("transposed", "sliced", "strided"):
            layouts = tuple(layout if j == i else "contiguous" for j in range(3))
            cases[f"{name}_{layout}"] = dataclasses.replace(base, lead=(3,), layouts=layouts)
    cases["qkv_transposed_4d"] = dataclasses.replace(base, layouts=("transposed",) * 3)
    for dtype_name, dtype in (("fp16", fp16), ("bf16", bf16)):
        for is_causal in (True, False):
            cases[f"{dtype_name}_{'causal' if is_causal else 'full'}"] = dataclasses.replace(
                base, dtype=dtype, is_causal=is_causal, head_dim=64, score_spread=2.0)
    # Scores up to about 250: exp of a score overflows fp32 past 88.7, so only a softmax that subtracts its
    # running maximum stays finite.
    for dtype_name, dtype in (("fp32", fp32), ("fp16", fp16), ("bf16", bf16)):
        for is_causal in (True, False):
            cases[f"large_scores_{dtype_name}_{'causal' if is_causal else 'full'}"] = dataclasses.replace(
                base, dtype=dtype, is_causal=is_causal, score_spread=60.0)
    return cases


NAMED_CASES = list(named_cases(on_gpu=False))


@pytest.mark.parametrize("case_name", NAMED_CASES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_named_case_matches_the_float64_reference_forward_and_backward(name, case_name, adapters, run_settings,
                                                                         device):
    case = named_cases(run_settings.on_gpu)[case_name]
    if not _runs_here(name, case.dtype, run_settings.on_gpu):
        pytest.skip(INTERPRETER_BF16)
    try:
        check_function(_function(adapters, name), case, device, LABELS[name])
        return
    except ConformanceFailure as failure:
        found = str(failure)
    pytest.fail(found, pytrace=False)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_is_causal_is_optional_and_defaults_to_false(name, adapters, device):
    function = _function(adapters, name)
    q, k, v, _ = Case((2,), 20, 20, 16, torch.float32, False).inputs(device)
    try:
        by_default = function.apply(q, k, v)
    except Exception as error:  # noqa: BLE001 - whatever the implementation raises is the finding
        pytest.fail(f"{LABELS[name]}: apply(q, k, v) raised {type(error).__name__}: {error}; the course's "
                    "interface makes is_causal optional, False by default", pytrace=False)
    full, causal = function.apply(q, k, v, False), function.apply(q, k, v, True)
    assert torch.equal(by_default, full), f"{LABELS[name]}: apply(q, k, v) differs from apply(q, k, v, False)"
    assert not torch.allclose(full, causal), f"{LABELS[name]}: apply(q, k, v, True) gives the full attention"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_forward_saves_exactly_one_tensor_shaped_like_the_query_rows_the_float32_logsumexp(name, adapters,
                                                                                             device):
    case = Case((2, 3), 24, 40, 16, torch.float16, True)
    q, k, v, do = case.inputs(device)
    lse = results_of(_function(adapters, name), q, k, v, do, True)["L"]
    assert lse.dtype == torch.float32, f"{LABELS[name]} saved L as {lse.dtype}; the contract is float32"


# ------------------------------------------------------------------------------- what the Triton Function runs

# Unequal to each other, to the head dim and to the leading dims: only a query-by-key matrix has both lengths.
PROMISE_CASE = Case((2, 3), 77, 130, 32, torch.float32, True)
# Distinct sentences a failure lists at most.
SENTENCES_SHOWN = 5


@pytest.fixture(scope="module")
def triton_function_calls(adapters, device):
    """The aten ops and Triton kernels of one forward and one backward of the Triton Function, apart."""
    case = dataclasses.replace(PROMISE_CASE, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    q, k, v, do = (t.detach() for t in case.inputs(device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    function = _function(adapters, TRITON)
    try:
        with recorded() as forward:
            o = function.apply(q, k, v, True)
        with recorded() as backward:
            torch.autograd.grad(o, (q, k, v), do)
    except Exception as error:  # noqa: BLE001 - whatever the implementation raises is the finding
        pytest.fail(f"the Triton Function raised where {case.describe()}: {type(error).__name__}: {error}",
                    pytrace=False)
    return case, {"forward": forward, "backward": backward}


@pytest.mark.adapters(TRITON)
def test_the_triton_function_launches_triton_kernels_in_its_forward_and_its_backward(triton_function_calls):
    case, calls = triton_function_calls
    for passed, recorded_calls in calls.items():
        if not recorded_calls.kernels:
            pytest.fail(f"the Triton Function launched no Triton kernel in its {passed} (where {case.describe()}): "
                        "it is not FlashAttention in Triton", pytrace=False)


@pytest.mark.adapters(TRITON)
def test_the_triton_function_does_attention_in_no_torch_op(triton_function_calls):
    case, calls = triton_function_calls
    for passed, recorded_calls in calls.items():
        found = list(dict.fromkeys(torch_attention(recorded_calls.ops, case.n_queries, case.n_keys)))
        if found:
            more = f"; and {len(found) - SENTENCES_SHOWN} more" if len(found) > SENTENCES_SHOWN else ""
            pytest.fail(f"the Triton Function's {passed} (where {case.describe()}) "
                        f"{'; '.join(found[:SENTENCES_SHOWN])}{more}: attention done in torch ops, not in Triton "
                        "kernels", pytrace=False)


# The conformance tests compute-sanitizer runs, few enough that memcheck's slowdown keeps them to minutes: the
# Triton Function's named cases at GPU sizes that reach the edges of its tiles and views (ragged tails, unequal
# lengths both ways, head dims that are no power of two, transposed 4-D inputs, bf16).
SANITIZED_TESTS = ("test_named_case and triton and (tails or queries_than_keys or head_dim_24 or head_dim_80 "
                   "or qkv_transposed_4d or bf16_causal)")
# Set in the sanitized run, so that this test does not start compute-sanitizer from inside it.
UNDER_SANITIZER = "CS336_CONFORMANCE_UNDER_SANITIZER"
SANITIZER_TIMEOUT_S = 1800


@pytest.mark.gpu
@pytest.mark.adapters(TRITON)
def test_compute_sanitizer_finds_no_memory_error_in_the_triton_function_s_launches(adapters, tmp_path):
    from cs336_systems.gpu_check import parse_junit, sanitizer_error_count, sanitizer_errors

    if os.environ.get(UNDER_SANITIZER):
        pytest.skip("this run is the one compute-sanitizer watches")
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer (part of the CUDA toolkit) is not on the PATH")
    junit = tmp_path / "memcheck.xml"
    command = ["compute-sanitizer", "--tool", "memcheck", sys.executable, "-m", "pytest", "--pyargs",
               "cs336_systems.conformance", "-p", "cs336_systems.pytest_plugin", "--adapters", adapters.spec,
               "--gpu", "auto", "-k", SANITIZED_TESTS,
               "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    # Without its caching allocator torch takes each tensor's memory from CUDA on its own, so that memcheck sees
    # where each tensor ends: inside a cached block a read past a tensor's end is a read of the block.
    environment = {**os.environ, UNDER_SANITIZER: "1", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=SANITIZER_TIMEOUT_S)
    output = result.stdout + result.stderr
    errors = sanitizer_error_count(output, "memcheck")
    assert errors is not None, f"compute-sanitizer printed no error summary:\n{output[-3000:]}"
    assert errors == 0, (f"compute-sanitizer memcheck found {errors} errors in {adapters.label}'s launches: "
                         + "; ".join(sanitizer_errors(output)[:SENTENCES_SHOWN]))
    summary = parse_junit(junit) if junit.exists() else None
    assert summary and summary["passed"] and not summary["failed"] + summary["errors"], (
        f"the conformance tests under compute-sanitizer did not all pass:\n{output[-3000:]}")
