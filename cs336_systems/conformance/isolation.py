"""Importing an implementation whose repository has its own `cs336_systems` package, as the course's does, in the
same process as this harness's package of that name.

A process holds one module of a name, and the harness's `cs336_systems` is imported first. So the implementation's
package is imported under another name, ISOLATED_NAME (`under_test_cs336_systems`), and every module of that
repository that the adapters import (the adapters module itself, its neighbours, the package) is compiled with its
absolute imports of `cs336_systems` renamed to it:

    from cs336_systems.flash import F  ->  from under_test_cs336_systems.flash import F
    import cs336_systems.ddp as ddp    ->  import under_test_cs336_systems.ddp as ddp
    import cs336_systems.ddp           ->  import under_test_cs336_systems.ddp
                                           cs336_systems = under_test_cs336_systems

Relative imports need nothing: a module's package is already the renamed one. The files are read as they are (no
copy, no cached bytecode), so tracebacks, `inspect.getsource` and Triton's JIT see the implementation's own lines.
What stays shared is `cs336_basics`: its layers (Linear, Embedding) are the vocabulary an FSDP implementation
recognises in the models the harness builds, so the implementation gets the harness's, as the course's tests give
it the course's. A module name built at run time (`importlib.import_module("cs336_systems.x")`) is not renamed.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ISOLATED_PACKAGE = "cs336_systems"
ISOLATED_NAME = f"under_test_{ISOLATED_PACKAGE}"


def their_package(adapters_path: Path) -> Path | None:
    """The implementation's own `cs336_systems` folder: the first found beside a folder above its adapters file,
    where that is not the harness's own package; None where it has none."""
    ours = Path(importlib.util.find_spec(ISOLATED_PACKAGE).origin).parent.resolve()
    for folder in adapters_path.parents:
        package = folder / ISOLATED_PACKAGE
        if (package / "__init__.py").is_file():
            return None if package.resolve() == ours else package.resolve()
    return None


class _RenameImports(ast.NodeTransformer):
    """Absolute imports of `cs336_systems` (and its submodules) renamed to ISOLATED_NAME; a plain `import
    cs336_systems.x` also binds the name `cs336_systems` to the renamed package, as the original import did."""

    @staticmethod
    def _renamed(dotted: str) -> str | None:
        top, dot, rest = dotted.partition(".")
        return ISOLATED_NAME + dot + rest if top == ISOLATED_PACKAGE else None

    def visit_Import(self, node: ast.Import) -> list[ast.stmt]:
        statements: list[ast.stmt] = []
        for alias in node.names:
            renamed = self._renamed(alias.name)
            if renamed is None:
                statements.append(ast.Import([alias]))
            elif alias.asname:
                statements.append(ast.Import([ast.alias(renamed, alias.asname)]))
            else:
                bound = ast.Assign([ast.Name(ISOLATED_PACKAGE, ast.Store())], ast.Name(ISOLATED_NAME, ast.Load()))
                statements += [ast.Import([ast.alias(renamed)]), bound]
        return [ast.copy_location(statement, node) for statement in statements]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom:
        if node.level == 0 and node.module and (renamed := self._renamed(node.module)):
            node.module = renamed
        return node


class _RenamingLoader(importlib.machinery.SourceFileLoader):
    """A source file compiled with its imports renamed (_RenameImports), always from its source: bytecode cached
    by a plain import of the same file would hold the original names."""

    def get_code(self, fullname: str):
        source = self.get_data(self.path)
        tree = ast.fix_missing_locations(_RenameImports().visit(ast.parse(source, filename=self.path)))
        return compile(tree, self.path, "exec", dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ISOLATED_NAME and its submodules in the implementation's package, and the modules that `search_root`
    (the folder the adapters module is imported from) provides, each with a _RenamingLoader."""

    def __init__(self, package: Path, search_root: Path):
        self.package = package
        self.search_root = search_root

    def find_spec(self, fullname: str, path=None, target=None):
        top = fullname.partition(".")[0]
        if fullname == ISOLATED_NAME:
            init = self.package / "__init__.py"
            return importlib.util.spec_from_file_location(fullname, init, loader=_RenamingLoader(fullname, str(init)),
                                                          submodule_search_locations=[str(self.package)])
        if top == ISOLATED_NAME:
            found = importlib.machinery.PathFinder.find_spec(fullname, path)
        elif top != ISOLATED_PACKAGE and self._provides(top):
            where = path if "." in fullname else [str(self.search_root)]
            found = importlib.machinery.PathFinder.find_spec(fullname, where)
        else:
            return None
        if found is None or not isinstance(found.loader, importlib.machinery.SourceFileLoader):
            return found
        found.loader = _RenamingLoader(fullname, found.origin)
        return found

    def _provides(self, top: str) -> bool:
        """Whether the top-level module `top` is one of search_root's (not one its sys.path holds elsewhere)."""
        return (self.search_root / f"{top}.py").is_file() or (self.search_root / top / "__init__.py").is_file()


def isolate(package: Path, search_root: Path) -> None:
    """Import the implementation whose `cs336_systems` is `package`, its adapters from `search_root`, under the
    renamed package from now on in this process. One implementation a process: another repository's package
    under the same name would be a different module that its callers could not tell apart."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            if (finder.package, finder.search_root) != (package, search_root):
                raise ValueError(f"this process already imports {finder.package} as {ISOLATED_NAME}; an "
                                 f"implementation with another cs336_systems ({package}) needs a process of its own")
            return
    sys.meta_path.insert(0, _Finder(package, search_root))
