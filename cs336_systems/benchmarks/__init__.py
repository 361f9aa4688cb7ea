"""Benchmarks, one module per problem family; each returns rows and registers its report renderers."""

import importlib
import pkgutil

# Import every module so that each registers the renderers of its problems.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
