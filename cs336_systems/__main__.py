"""Command line: one benchmark, one number (or a small sweep), without pytest.

    python -m cs336_systems e2e --size xl --context 512 --precision bf16 --compile
    python -m cs336_systems e2e --size xl --context 512 --attention sdpa --optimizer fused
    python -m cs336_systems e2e --size small,medium --context 128,256 --json
    python -m cs336_systems e2e --size-table 2025 --size 2.7B --context 512
    python -m cs336_systems accumulation
    python -m cs336_systems autocast-dtypes
    python -m cs336_systems analysis
    python -m cs336_systems index --reports elsewhere/reports
    python -m cs336_systems rerender
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from pathlib import Path

from cs336_systems.checks import repeated

log = logging.getLogger("cs336_systems")


class _Parser(argparse.ArgumentParser):
    """Errors as one line, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _list(item_type):
    """Comma-separated values, spaces around each ignored; at least one, none twice."""
    def parse(text: str):
        values = [item_type(t.strip()) for t in text.split(",") if t.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"needs at least one value, got {text!r}")
        if twice := repeated(values):
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given more than once")
        return values

    return parse


def _device(choice: str):
    import torch

    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU")
    return torch.device(choice)


def _print_rows(rows, as_json: bool, columns=None) -> None:
    from cs336_systems.reports import markdown_table

    if as_json:
        for row in rows:
            print(json.dumps(row, default=str))
    else:
        print(markdown_table(rows, columns), end="")


def _cmd_e2e(args) -> None:
    from cs336_systems.interpretation import interpret_kernels, interpreter_problem

    device = _device(args.device)
    if device.type != "cuda" and args.attention == "flash_triton" and (problem := interpreter_problem()):
        raise SystemExit(f"e2e --attention flash_triton on {device}: {problem}")
    # Before the benchmark imports the kernels; the environment is put back for whatever this process
    # starts afterwards (the command may run inside another program).
    restore = interpret_kernels(on_gpu=device.type == "cuda")
    try:
        _e2e(args, device)
    finally:
        restore()


def _e2e(args, device) -> None:
    from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_model, split_breakdown
    from cs336_systems.clocks import CLOCK_COLUMNS
    from cs336_systems.gpus import resolve_gpu
    from cs336_systems.model import size_name
    from cs336_systems.reports.e2e import command_status, nothing_measured_note
    from cs336_systems.rows import COURSE_VARIANT, REFERENCE_MODEL

    _, spec = resolve_gpu("auto" if device.type == "cuda" else "none")
    if args.optimizer is not None and args.mode != "train":
        raise ValueError(f"--optimizer: a {args.mode} step runs no optimizer; it applies to --mode train")
    optimizer = args.optimizer or COURSE_VARIANT[1]
    sizes = [size_name(size, args.size_table) for size in args.size]
    if twice := repeated(sizes):
        raise ValueError(f"--size: {', '.join(twice)} given more than once")
    cells = [
        E2EConfig(size=size, context_length=context, batch_size=args.batch_size, mode=args.mode,
                  precision=precision, compile=args.compile, attention=args.attention, optimizer=optimizer,
                  warmup=args.warmup, steps=args.steps, model_context_length=args.model_context,
                  size_table=args.size_table)
        for size, context, precision in itertools.product(sizes, args.context, args.precision)
    ]  # built first, so bad input fails before anything runs
    if args.reference and args.attention != "sdpa":
        raise ValueError(f"--reference: the torch reference uses SDPA attention; got --attention {args.attention}")
    rows = []
    for i, cell in enumerate(cells, 1):
        if len(cells) > 1:
            log.info("[%d/%d] %s, context %d, %s%s", i, len(cells), cell.size, cell.context_length,
                     cell.precision, ", compiled" if cell.compile else "")
        peak = spec.peak_flops(cell.precision) if spec else None
        models = {"project": False, REFERENCE_MODEL: True} if args.reference else {None: False}
        for model, reference in models.items():
            where = f"{f'{model}: ' if model else ''}{cell.size} at context {cell.context_length:,}, {cell.precision}"
            model_rows = benchmark_model(cell, device, peak, reference=reference, profiled_steps=args.breakdown,
                                         announce=_announcer(where, device, args.breakdown))
            if note := nothing_measured_note(model_rows):
                log.warning("%s: %s", where, note)
            rows += [{"model": model, **row} for row in model_rows] if model == "project" else model_rows
    if args.json:
        _print_rows(rows, True)
        return
    model = ["model"] if args.reference else []
    cell = [*model, "size", "context_length", "precision", "attention", "optimizer", "compile", "phase", "status"]
    timed, breakdown = split_breakdown([{**row, "status": command_status(row)} for row in rows])
    clocks = [*CLOCK_COLUMNS] if any(CLOCK_COLUMNS[0] in row for row in timed) else []
    _print_rows(timed, False, [*cell, "mean_ms", "std_ms", "median_ms", "iqr_ms", "host_ms", "tflops", "mfu", *clocks,
                               "estimated_peak_bytes", "available_bytes"])
    if breakdown:
        print()
        _print_rows(breakdown, False, [*cell, "work_ms", "matmul_ms", "attention_ms", "other_ms", "step_ms",
                                       "busy_ms", "idle_ms", "span_ms"])


def _announcer(where: str, device, profiled_steps: int):
    """What the command says before a cell's steps run (benchmark_model's announce), each line starting with
    `where`: what runs in place of a mode that did not fit, and how long it will take where that is minutes."""
    from cs336_systems.benchmarks.e2e import cell_cost
    from cs336_systems.reports.e2e import long_cell_note, stand_in_note

    def announce(measured, did_not_fit) -> None:
        if did_not_fit:
            log.warning("%s: %s", where, stand_in_note(did_not_fit, measured.mode))
        if note := long_cell_note(cell_cost(measured, device, profiled_steps), measured.mode):
            log.warning("%s: %s", where, note)

    return announce


def _cmd_accumulation(args) -> None:
    from cs336_systems.benchmarks.mixed_precision import accumulation_experiment
    from cs336_systems.reports.mixed_precision import accumulation_table

    rows = accumulation_experiment()
    if args.json:
        _print_rows(rows, as_json=True)
    else:
        print(accumulation_table(rows), end="")


def _cmd_autocast_dtypes(args) -> None:
    from cs336_systems.benchmarks.mixed_precision import autocast_dtypes_experiment

    _print_rows(autocast_dtypes_experiment(_device(args.device)), args.json)


def _cmd_analysis(args) -> None:
    from cs336_systems.reports import ANALYSIS_COMMAND
    from cs336_systems.reports.communication_accounting import write_communication_accounting
    from cs336_systems.reports.parallelism_calcs import write_parallelism_calcs

    reports_root, command = _reports_root(args, ANALYSIS_COMMAND, must_exist=False)
    for path in [write_communication_accounting(reports_root, command), *write_parallelism_calcs(reports_root, command)]:
        print(path)


def _cmd_index(args) -> None:
    from cs336_systems.reports.index import INDEX_COMMAND, write_indexes

    for path in write_indexes(*_reports_root(args, INDEX_COMMAND, must_exist=True)):
        print(path)


def _cmd_rerender(args) -> None:
    from cs336_systems.reports import metadata_path, rerender
    from cs336_systems.reports.index import INDEX_COMMAND, write_indexes
    from cs336_systems.reports.problems import report

    reports_root, command = _reports_root(args, INDEX_COMMAND, must_exist=True)
    for csv in sorted(reports_root.glob("*/*.csv")):
        if metadata_path(csv.parent, csv.stem).is_file():
            print(rerender(csv.parent, report(csv.stem)))
    for path in write_indexes(reports_root, command):
        print(path)


def _reports_root(args, command: str, must_exist: bool):
    """The reports' root a command writes to, and the command as its files record it: `--reports` only where it
    was given (the default is the repository's `reports/`, from any folder). A given root must be a folder, or
    where one can be made unless the command reads what is there (`must_exist`)."""
    from cs336_systems.reports import default_reports_root

    if args.reports is None:
        return default_reports_root(), command
    root = Path(args.reports)
    if not args.reports.strip():
        raise ValueError("--reports is empty; name the reports' root folder")
    if root.exists() and not root.is_dir():
        raise ValueError(f"--reports {args.reports} is a file, not a folder")
    if must_exist and not root.is_dir():
        raise ValueError(f"--reports {args.reports}: no such folder")
    return root, f"{command} --reports {args.reports}"


REPORTS_ROOT_HELP = "reports/ in the repository's root, from any folder"


def build_parser() -> argparse.ArgumentParser:
    from cs336_systems.accounting.activations import ADAMW_IMPLEMENTATIONS
    from cs336_systems.attention import ATTENTION_VARIANTS
    from cs336_systems.benchmarks.e2e import DEFAULT_BATCH_SIZE, DEFAULT_STEPS, DEFAULT_WARMUP
    from cs336_systems.model import DEFAULT_SIZE_TABLE, SIZE_TABLES
    from cs336_systems.precision import PRECISIONS
    from cs336_systems.rows import COURSE_VARIANT
    from cs336_systems.rows.e2e import MODEL_MODES

    parser = _Parser(prog="python -m cs336_systems", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=_Parser)

    def common(sub):
        sub.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                         help="where to run (default: auto, the GPU if torch sees one)")
        sub.add_argument("--json", action="store_true", help="print rows as JSON lines")

    e2e = commands.add_parser("e2e", help="time forward / backward / optimizer steps of the LM")
    e2e.add_argument("--size", type=_list(str), required=True,
                     help="model size(s), comma-separated, in any case: any of "
                          f"{', '.join(SIZE_TABLES[DEFAULT_SIZE_TABLE])} or tiny")
    e2e.add_argument("--size-table", choices=tuple(SIZE_TABLES), default=DEFAULT_SIZE_TABLE,
                     help=f"the handout whose size table --size names (default: {DEFAULT_SIZE_TABLE}; 2025 has "
                          "xl = 1600/6400/48/25 and 2.7B)")
    e2e.add_argument("--context", type=_list(_positive_int), required=True, help="context length(s), comma-separated")
    e2e.add_argument("--model-context", type=_positive_int, default=None,
                     help="the model's maximum context (default: --context)")
    e2e.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
                     help=f"sequences per step (default: {DEFAULT_BATCH_SIZE})")
    e2e.add_argument("--mode", choices=MODEL_MODES, default="train",
                     help="what a step runs: forward only (no autograd), forward and backward, or a full AdamW "
                          "training step (default: train)")
    e2e.add_argument("--precision", type=_list(str), default=["fp32"],
                     help=f"comma-separated, any of {', '.join(PRECISIONS)}; bf16 and fp16 run under autocast "
                          "(default: fp32)")
    e2e.add_argument("--compile", action="store_true", help="torch.compile each Transformer block")
    e2e.add_argument("--reference", action="store_true",
                     help="also time a torch-native LM of the same architecture (nn modules, SDPA; compiled whole "
                          "with --compile) after each cell: what the project's model and harness cost (needs "
                          "--attention sdpa)")
    e2e.add_argument("--attention", choices=ATTENTION_VARIANTS, default=COURSE_VARIANT[0],
                     help=f"(default: {COURSE_VARIANT[0]}, the course model's)")
    e2e.add_argument("--optimizer", choices=ADAMW_IMPLEMENTATIONS, default=None,
                     help=f"the AdamW of train steps (--mode train only): the course model's own (one parameter at a "
                          f"time), torch's fused kernel, or torch's multi-tensor one (default: {COURSE_VARIANT[1]})")
    e2e.add_argument("--warmup", type=_non_negative_int, default=DEFAULT_WARMUP,
                     help=f"untimed steps first (default: {DEFAULT_WARMUP})")
    e2e.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                     help=f"timed steps (default: {DEFAULT_STEPS})")
    e2e.add_argument("--breakdown", type=_non_negative_int, default=0, metavar="STEPS",
                     help="after the timed steps, profile this many more with torch.profiler and print where a "
                          "step's time goes: each phase's kernel time by kind, GPU busy and idle time (default: 0)")
    common(e2e)
    e2e.set_defaults(run=_cmd_e2e)

    accumulation = commands.add_parser("accumulation", help="fp32 / fp16 / mixed accumulation of 0.01, on the CPU")
    accumulation.add_argument("--json", action="store_true", help="print rows as JSON lines")
    accumulation.set_defaults(run=_cmd_accumulation)

    dtypes = commands.add_parser("autocast-dtypes", help="dtypes inside a toy model under autocast")
    common(dtypes)
    dtypes.set_defaults(run=_cmd_autocast_dtypes)

    analysis = commands.add_parser("analysis", help="write the closed-form reports (communication_accounting and "
                                   "the parallelism calculations) into <reports>/")
    analysis.add_argument("--reports", default=None, help=f"the reports' root directory (default: {REPORTS_ROOT_HELP})")
    analysis.set_defaults(run=_cmd_analysis)

    index = commands.add_parser("index", help="write <reports>/README.md, the GPU reports' index, from their CSVs "
                                "(and <reports>/cpu/README.md where a CPU run left reports)")
    index.add_argument("--reports", default=None, help=f"the reports' root directory (default: {REPORTS_ROOT_HELP})")
    index.set_defaults(run=_cmd_index)

    rerender = commands.add_parser("rerender", help="write every device report's Markdown and figures again from its "
                                   "rows and metadata, then the index: after an edit on a measured path, their "
                                   "headers mark the runs it leaves on earlier code")
    rerender.add_argument("--reports", default=None, help=f"the reports' root directory (default: {REPORTS_ROOT_HELP})")
    rerender.set_defaults(run=_cmd_rerender)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no command: say which there are
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        args.run(args)
    except ValueError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
