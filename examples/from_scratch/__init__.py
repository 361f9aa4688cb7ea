"""A from-scratch implementation of the course's adapter interface, written without this project's classes:
the README's worked example of pointing the harness at someone else's code, and the correct module the
harness's own tests hold the conformance suite to (tests/broken_adapters plant one bug each in copies of its
parts)."""
