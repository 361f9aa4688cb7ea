"""The FlashAttention conformance suite (cs336_systems/conformance/test_flash_attention.py) holds itself to account:
run against each adapters module of tests/broken_adapters that plants one bug in a copy of examples/from_scratch's
FlashAttention, it must fail where the bug shows, with a message that names it, and pass where it does not; run
against this project's adapters and the from-scratch ones, it must pass.

Each run is the suite's own tests selected with -k, in this process (pytester), under a hypothesis profile that
neither shrinks a failing example nor draws examples afresh each run: a user's run keeps hypothesis's defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import Phase, settings

# Imported here, before any run: an in-process run takes away the modules it imported when it ends, and Triton's
# compiled extension cannot be imported twice in one process, so each Triton the runs use must stay imported.
import cs336_systems.attention.flash_triton  # noqa: F401, E402
import examples.from_scratch.flash  # noqa: F401, E402

REPO_ROOT = Path(__file__).resolve().parents[1]
BROKEN = REPO_ROOT / "tests" / "broken_adapters"
SUITE = ("--pyargs", "cs336_systems.conformance.test_flash_attention", "-p", "cs336_systems.pytest_plugin",
         "-p", "no:cacheprovider")
# The same examples every run, and the first failing one reported as found: shrinking it (minutes against a
# broken module whose every example fails) would only make the message's case smaller.
KILL_PROFILE = "cs336-flash-kills"
settings.register_profile(KILL_PROFILE, derandomize=True, database=None, report_multiple_bugs=False,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate))
TEST_NAMED = "test_named_case_matches_the_float64_reference_forward_and_backward"
TEST_DRAWN = "test_drawn_inputs_match_the_float64_reference_forward_and_backward"
SANITIZER_TEST = "test_compute_sanitizer_finds_no_memory_error_in_the_triton_function_s_launches"


@dataclass(frozen=True)
class Kill:
    """A broken module, the suite's tests to run on it (-k), the tests that must fail with what each failure must
    say (a regex over its report), and those that must pass: where the bug does not show."""

    module: str
    selection: str
    fails: dict[str, str]
    passes: tuple[str, ...] = ()
    needs_gpu: str = field(default="")  # why only a GPU shows the bug, where it does


def named(function: str, case: str) -> str:
    return f"{TEST_NAMED}[{function}-{case}]"


# The next line of a failure's list of discrepancies, in a report that may prefix its lines with "E".
NEXT = r"\n[E ]*- "
CAUSAL_FAILURE = r"Function is wrong where is_causal=True"
L_OFF = r"the saved logsumexp L is off by"
KILLS = [
    Kill("flash_pytorch_forward_ignores_causal", "pytorch and (causal_fewer or full_fewer)",
         {named("pytorch", "causal_fewer_queries_than_keys"): rf"PyTorch {CAUSAL_FAILURE}.*{NEXT}{L_OFF}"},
         (named("pytorch", "full_fewer_queries_than_keys"),)),
    # The forward is right: the first results named are the gradients.
    Kill("flash_pytorch_backward_ignores_causal", "pytorch and (causal_fewer or full_fewer)",
         {named("pytorch", "causal_fewer_queries_than_keys"): rf"PyTorch {CAUSAL_FAILURE}.*{NEXT}dq differs"},
         (named("pytorch", "full_fewer_queries_than_keys"),)),
    # Where every query's keys lie in whole tiles (causal, fewer queries than a tile), it passes.
    Kill("flash_triton_drops_keys_past_the_last_whole_tile", "triton and (tails or _fewer)",
         {named("triton", "full_tails_past_every_tile_size"): rf"n_k=\d+.*{NEXT}{L_OFF}",
          named("triton", "full_fewer_queries_than_keys"): L_OFF},
         (named("triton", "causal_fewer_queries_than_keys"),)),
    Kill("flash_causal_mask_bottom_right", "pytorch and (causal_fewer or causal_more or causal_tails)",
         {named("pytorch", "causal_fewer_queries_than_keys"): rf"{CAUSAL_FAILURE}, n_q=\d+, n_k=\d+.*{NEXT}{L_OFF}",
          named("pytorch", "causal_more_queries_than_keys"): rf"{CAUSAL_FAILURE}, n_q=\d+, n_k=\d+.*{NEXT}{L_OFF}"},
         (named("pytorch", "causal_tails_past_every_tile_size"),)),
    Kill("flash_pytorch_accumulates_in_input_dtype", "pytorch and (bf16_full or causal_fewer)",
         {named("pytorch", "bf16_full"): rf"bf16.*{NEXT}{L_OFF}"},
         (named("pytorch", "causal_fewer_queries_than_keys"),)),
    Kill("flash_triton_is_pytorch", "triton and (launches_triton or torch_op)",
         {"test_the_triton_function_launches_triton_kernels_in_its_forward_and_its_backward":
              "the Triton Function launched no Triton kernel in its forward",
          "test_the_triton_function_does_attention_in_no_torch_op":
              r"the Triton Function's forward .* ran aten::bmm on .*: attention done in torch ops"}),
    Kill("flash_triton_backward_in_pytorch", "triton and (launches_triton or torch_op)",
         {"test_the_triton_function_launches_triton_kernels_in_its_forward_and_its_backward":
              "the Triton Function launched no Triton kernel in its backward",
          "test_the_triton_function_does_attention_in_no_torch_op":
              r"the Triton Function's backward .* ran aten::bmm on .*: attention done in torch ops"}),
    Kill("flash_triton_reads_views_as_contiguous", "triton and (q_transposed or k_sliced or v_strided or 3d_inputs)",
         {named("triton", "q_transposed"): rf"q transposed:{NEXT}{L_OFF}",
          named("triton", "k_sliced"): rf"k sliced:{NEXT}{L_OFF}",
          named("triton", "v_strided"): rf"v strided:{NEXT}o differs"},
         (named("triton", "3d_inputs"),)),
    # A softmax scale 1% off, in fp32, fp16 and bf16 (bf16 through Triton on a GPU: the next kill).
    Kill("flash_pytorch_scale_one_percent_off", "pytorch and (causal_fewer or fp16_causal or bf16_causal)",
         {named("pytorch", case): rf"{dtype}.*{NEXT}{L_OFF}"
          for case, dtype in (("causal_fewer_queries_than_keys", "fp32"), ("fp16_causal", "fp16"),
                              ("bf16_causal", "bf16"))}),
    Kill("flash_triton_scale_one_percent_off", "triton and (causal_fewer or fp16_causal)",
         {named("triton", case): rf"{dtype}.*{NEXT}{L_OFF}"
          for case, dtype in (("causal_fewer_queries_than_keys", "fp32"), ("fp16_causal", "fp16"))}),
    Kill("flash_triton_scale_one_percent_off", "triton and bf16_causal",
         {named("triton", "bf16_causal"): rf"bf16.*{NEXT}{L_OFF}"},
         needs_gpu="bf16 through Triton runs on a GPU only"),
    Kill("flash_pytorch_scale_one_percent_off", f"pytorch and {TEST_DRAWN}",
         {f"{TEST_DRAWN}[pytorch]": rf"PyTorch Function is wrong where .*{NEXT}{L_OFF}"}),
    Kill("flash_saves_logsumexp_in_base_2", "pytorch and (causal_fewer or full_fewer)",
         {named("pytorch", case): rf"is wrong where .*:{NEXT}{L_OFF} [^\n]*$"
          for case in ("causal_fewer_queries_than_keys", "full_fewer_queries_than_keys")}),
    Kill("flash_triton_no_max_subtraction", "triton and (large_scores_fp32 or causal_fewer)",
         {named("triton", f"large_scores_fp32_{mask}"): r"NaN or infinite values .* past exp's range in fp32: is "
                                                        r"the running maximum subtracted before exp\?"
          for mask in ("causal", "full")},
         (named("triton", "causal_fewer_queries_than_keys"),)),
    Kill("flash_pytorch_only_3d_inputs", "pytorch and (3d_inputs or causal_fewer)",
         {named("pytorch", "causal_fewer_queries_than_keys"):
              r"PyTorch Function raised where .*4-D inputs .*ValueError: too many values to unpack"},
         (named("pytorch", "3d_inputs"),)),
    Kill("flash_triton_scale_of_the_padded_head_dim", "triton and head_dim",
         {named("triton", f"head_dim_{d}"): rf"d={d}, .*{NEXT}{L_OFF}" for d in (24, 80)},
         (named("triton", "head_dim_16"), named("triton", "head_dim_128"))),
    Kill("flash_triton_reads_past_the_last_key", "compute_sanitizer",
         {SANITIZER_TEST: r"compute-sanitizer memcheck found \d+ errors in adapters .*: Invalid __global__ read"},
         needs_gpu="compute-sanitizer watches GPU launches"),
]


@pytest.fixture
def conformance_run(pytester, run_settings):
    """Runs the suite's tests against an adapters module, in this process, and gives each test's failure text
    (None where it passed) by test name; the hypothesis profile it loads is put back afterwards."""
    profile = settings.get_current_profile_name()

    def run(adapters: Path, *arguments: str) -> dict[str, str | None]:
        gpu = "auto" if run_settings.on_gpu else "none"
        recorder = pytester.inline_run(*SUITE, "--adapters", str(adapters), "--gpu", gpu,
                                       "--hypothesis-profile", KILL_PROFILE, *arguments)
        assert recorder.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), (
            f"the conformance run against {adapters} ended with {recorder.ret!r}")
        outcomes: dict[str, str | None] = {}
        for report in recorder.getreports("pytest_runtest_logreport"):
            name = report.nodeid.split("::")[-1]
            if report.failed:
                outcomes[name] = report.longreprtext
            elif report.when == "call" or (report.skipped and name not in outcomes):
                outcomes.setdefault(name, None if report.passed else "skipped: " + report.longreprtext)
        return outcomes

    yield run
    settings.load_profile(profile)


@pytest.mark.flash
@pytest.mark.parametrize("kill", KILLS, ids=[f"{kill.module}-{kill.selection}" for kill in KILLS])
def test_the_flash_conformance_suite_fails_a_planted_bug_naming_it(kill, conformance_run, run_settings):
    if kill.needs_gpu and not run_settings.on_gpu:
        pytest.skip(f"{kill.needs_gpu} (run is on CPU)")
    outcomes = conformance_run(BROKEN / f"{kill.module}.py", "-k", kill.selection)
    for test, pattern in kill.fails.items():
        assert test in outcomes, f"{test} did not run: {sorted(outcomes)}"
        assert outcomes[test] is not None, f"{kill.module}: {test} passed"
        assert re.search(pattern, outcomes[test]), f"{kill.module}: {test} failed without naming the bug:\n" \
                                                  f"{outcomes[test][-3000:]}"
    for test in kill.passes:
        assert outcomes.get(test, "did not run") is None, f"{kill.module}: {test} should pass: {outcomes.get(test)}"
    # On a GPU compute-sanitizer's test watches the broken module for minutes: only the kill that names it runs it.
    assert SANITIZER_TEST in kill.fails or SANITIZER_TEST not in outcomes, (
        f"{kill.module}: -k {kill.selection!r} also selects {SANITIZER_TEST}")


def test_every_broken_flash_module_is_tried():
    assert sorted({kill.module for kill in KILLS}) == sorted(path.stem for path in BROKEN.glob("flash_*.py"))


# Where the suite's tests skip against a correct module: what the run's device cannot run.
EXPECTED_SKIPS = ("bf16 through Triton runs on a GPU only", "needs a CUDA GPU")


@pytest.mark.flash
@pytest.mark.parametrize("adapters_file", ["cs336_systems/adapters.py", "examples/from_scratch/adapters.py"])
def test_correct_adapters_pass_the_flash_conformance_suite(adapters_file, conformance_run):
    outcomes = conformance_run(REPO_ROOT / adapters_file)
    failed = {test: text for test, text in outcomes.items() if text is not None and not text.startswith("skipped")}
    assert not failed, "\n\n".join(f"{test}:\n{text[-2000:]}" for test, text in failed.items())
    skipped = [text for text in outcomes.values() if text is not None and text.startswith("skipped")]
    assert all(any(reason in text for reason in EXPECTED_SKIPS) for text in skipped), skipped
    assert sum(text is None for text in outcomes.values()) > len(skipped)
