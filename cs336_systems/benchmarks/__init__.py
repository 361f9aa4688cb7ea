"""Benchmarks, one module per problem family; each returns rows, registers its report renderers and,
beside them, answers its problems from those rows for the reports' index."""

import importlib
import logging
import pkgutil

# Import every module so that each registers the renderers of its problems. A module that fails to
# import costs only its own reports their renderer; the others must still be written.
for _module in pkgutil.iter_modules(__path__):
    try:
        importlib.import_module(f"{__name__}.{_module.name}")
    except Exception:
        logging.getLogger(__name__).exception("could not import %s.%s; its reports render as plain tables",
                                              __name__, _module.name)
