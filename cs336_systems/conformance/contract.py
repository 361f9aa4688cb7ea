"""The course's adapter interface: the functions an implementation under test provides, and how the harness
finds them.

    adapters = load_adapters("path/to/tests/adapters.py")     # or a module name; None: this project's own
    adapters.missing("get_ddp", "ddp_on_after_backward")      # [] when both are implemented
    get_ddp = adapters.function("get_ddp")

The contract is the course's `tests/adapters.py`, 2025 and 2026 releases: each name below is a function the
course's tests call. An implementation provides any subset; the harness tests what it provides and says, by
name, what it lacks. A function whose body only raises NotImplementedError (the course's skeleton) counts as
lacking. Nothing here imports an implementation until `load_adapters` is called, and nothing imports pytest:
the plugin turns a LookupError into a skip and an AdaptersImportError into a usage error.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
import traceback
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from cs336_systems.conformance.isolation import ISOLATED_NAME, ISOLATED_PACKAGE, isolate, their_package

# Every function of the course's adapter interface, with what it returns or does. The 2026 release keeps the
# 2025 names and adds get_ddp (DDP overlapping backward, the name its DDP tests use) and FSDP.
ADAPTER_FUNCTIONS = {
    "get_flashattention_autograd_function_pytorch": "the FlashAttention-2 autograd.Function in plain PyTorch",
    "get_flashattention_autograd_function_triton": "the FlashAttention-2 autograd.Function whose passes are "
                                                   "Triton kernels",
    "get_ddp_individual_parameters": "DDP all-reducing each gradient as backward produces it",
    "ddp_individual_parameters_on_after_backward": "the hook called after backward, before the optimizer step",
    "get_ddp_bucketed": "DDP all-reducing gradients in buckets of at most bucket_size_mb",
    "ddp_bucketed_on_after_backward": "the hook called after backward, before the optimizer step",
    "ddp_bucketed_on_train_batch_start": "the hook called before each batch's forward",
    "get_sharded_optimizer": "an optimizer keeping state for about 1/world_size of the parameters per rank",
    "get_ddp": "(2026) DDP overlapping communication with backward",
    "ddp_on_after_backward": "(2026) the hook called after backward, before the optimizer step",
    "get_fsdp": "(2026) FSDP: Linear and Embedding weights sharded across ranks, optional compute dtype",
    "fsdp_on_after_backward": "(2026) the hook called after backward, before the optimizer step",
    "fsdp_gather_full_params": "(2026) every parameter, unsharded, by name",
}
# This project's own implementations: the default when no module is named.
OWN_ADAPTERS = "cs336_systems.adapters"
# The course's package of model layers, which this project also provides (a compatibility name for the course's
# tests: its Linear, Embedding, RMSNorm and TransformerLM are cs336_systems.model's). An implementation under test
# shares it with the harness (conformance.isolation says why); its own cs336_systems is imported under another name.
SHARED_BASICS = "cs336_basics"


class AdaptersImportError(ValueError):
    """The adapters module could not be found or imported; the message says which and why."""


class MissingAdapter(LookupError):
    """The adapters module lacks a function the calling test needs; the message names it."""


@dataclass(frozen=True)
class Adapters:
    """An imported adapters module: `spec` is what a fresh process passes to load_adapters to import it again
    (ranks of a distributed check do), `label` how reports and messages name it, `isolated_package` its
    repository's own cs336_systems where it has one (imported under another name: conformance.isolation)."""

    module: ModuleType
    spec: str
    label: str
    implemented: frozenset[str] = field(default_factory=frozenset)
    isolated_package: Path | None = None

    @property
    def is_own(self) -> bool:
        return self.spec == OWN_ADAPTERS

    def missing(self, *names: str) -> list[str]:
        """Those of `names` this module does not implement, in the order given."""
        unknown = [name for name in names if name not in ADAPTER_FUNCTIONS]
        if unknown:
            raise ValueError(f"not adapter functions of the course's interface: {', '.join(unknown)}")
        return [name for name in names if name not in self.implemented]

    def why_missing(self, *names: str) -> str | None:
        """A sentence naming those of `names` this module lacks, or None when it has them all."""
        lacking = self.missing(*names)
        if not lacking:
            return None
        return f"{self.label} does not implement {', '.join(lacking)}"

    def function(self, name: str):
        """The adapter function `name`; MissingAdapter, naming it, where the module lacks it."""
        if reason := self.why_missing(name):
            raise MissingAdapter(reason)
        return getattr(self.module, name)


def is_unimplemented(function) -> bool:
    """True for a function whose body (its docstring aside) only raises NotImplementedError, as the course's
    skeleton adapters do; a function whose source cannot be read is taken as implemented."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef) else []
    statements = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(statements) != 1 or not isinstance(statements[0], ast.Raise) or statements[0].exc is None:
        return False
    raised = statements[0].exc.func if isinstance(statements[0].exc, ast.Call) else statements[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def load_adapters(spec: str | None = None, relative_to: Path | None = None) -> Adapters:
    """Import the adapters module `spec` names: a path to a .py file (or a package folder), relative to
    `relative_to` (the current folder by default), or a dotted module name; None is this project's own.

    A file inside packages (folders with __init__.py) is imported under its dotted name, with the folder
    above the outermost package put first on sys.path, so that its relative imports work as in its own
    repository. Where a folder above it holds a `cs336_systems` package other than this harness's (the course's
    repository does), that package is imported under another name (conformance.isolation). AdaptersImportError
    where it cannot be imported or defines none of the interface's functions.
    """
    return _load(OWN_ADAPTERS if spec is None else spec.strip(), relative_to or Path.cwd())


@cache
def _load(spec: str, relative_to: Path) -> Adapters:
    if not spec:
        raise AdaptersImportError("--adapters is empty; name a module or a .py file")
    given = spec
    path = (relative_to / spec).resolve() if _looks_like_a_path(spec) else None
    package = None
    if path is not None:
        module_name, search_root = _module_name_of(path)
        spec, where = str(path), f"{given} ({path}, imported as {module_name})"
        if (package := their_package(path)) is not None:
            # Its finder imports from search_root. On sys.path, search_root would come before the harness's own
            # cs336_systems in the fresh processes that ranks start in (they inherit sys.path).
            try:
                isolate(package, search_root)
            except ValueError as error:
                raise AdaptersImportError(f"--adapters {given}: {error}") from None
            where += f", its {ISOLATED_PACKAGE} as {ISOLATED_NAME}"
        elif str(search_root) not in sys.path:
            sys.path.insert(0, str(search_root))
    else:
        module_name, where = spec, spec
    label = "this project's adapters" if spec == OWN_ADAPTERS else f"adapters {given}"
    try:
        module = importlib.import_module(module_name)
    except BaseException as error:  # noqa: BLE001 - a module's import can raise anything, SystemExit included
        raise AdaptersImportError(_import_failure(where, path, error)) from None
    defined = {name for name in ADAPTER_FUNCTIONS if callable(getattr(module, name, None))}
    if not defined:
        raise AdaptersImportError(f"{label} ({getattr(module, '__file__', module_name)}) defines none of the "
                                  f"course's adapter functions ({', '.join(ADAPTER_FUNCTIONS)})")
    implemented = frozenset(name for name in defined if not is_unimplemented(getattr(module, name)))
    return Adapters(module=module, spec=spec, label=label, implemented=implemented, isolated_package=package)


def _looks_like_a_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec or spec in (".", "..")


def _module_name_of(path: Path) -> tuple[str, Path]:
    """The dotted name a file or package folder is imported under, and the folder that name is found from."""
    if not path.exists():
        raise AdaptersImportError(f"--adapters {path}: no such file or folder")
    if path.is_dir():
        if not (path / "__init__.py").is_file():
            raise AdaptersImportError(f"--adapters {path} is a folder but not a package (no __init__.py); "
                                      "name the adapters .py file")
        parts, folder = [path.name], path.parent
    elif path.suffix != ".py":
        raise AdaptersImportError(f"--adapters {path} is not a .py file")
    else:
        parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts), folder


# Lines of the failed import's traceback a usage error shows: the last frames, where the error was raised.
IMPORT_FRAMES_SHOWN = 4


def _import_failure(where: str, path: Path | None, error: BaseException) -> str:
    """The usage error's text: what failed, the clash with this harness's package names where that is why,
    and the last frames of the import outside Python's own import machinery."""
    lines = [f"--adapters {where} failed to import: {type(error).__name__}: {error}"]
    if clash := _shared_package_clash(path, error):
        lines.append(clash)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<frozen")]
    lines += [line.rstrip() for line in traceback.format_list(frames[-IMPORT_FRAMES_SHOWN:])]
    return "\n".join(lines)


def _shared_package_clash(path: Path | None, error: BaseException) -> str | None:
    """Why an implementation that imports what the harness's cs336_basics lacks cannot be imported here: that
    name is the harness's, and one process imports one module of a name."""
    if not isinstance(error, ImportError) or not error.name or error.name.split(".")[0] != SHARED_BASICS:
        return None
    theirs = next((folder / SHARED_BASICS for folder in (path.parents if path else ())
                   if (folder / SHARED_BASICS / "__init__.py").is_file()), None)
    instead = f", not {theirs}," if theirs is not None else ""
    return (f"{SHARED_BASICS} here is the harness's{instead} ({importlib.util.find_spec(SHARED_BASICS).origin}): "
            "its model's Linear, Embedding, RMSNorm and TransformerLM, the layers the harness builds its models "
            "from; import anything else from elsewhere")
