"""The course's adapter module, where its test files import it from (`from .adapters import ...`): this
project's own implementations, cs336_systems.adapters."""

from cs336_systems.adapters import *  # noqa: F403
from cs336_systems.adapters import __all__  # noqa: F401
