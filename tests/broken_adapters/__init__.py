"""Adapters modules with one planted bug each: the conformance suite must catch every one, naming the bug
(tests/test_conformance_*.py). Each plants its bug into a copy of a part of examples/from_scratch, which
passes."""
