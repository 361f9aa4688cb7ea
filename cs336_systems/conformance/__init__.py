"""The conformance suite: what any implementation of the course's adapter interface must do, checked through
its adapters alone, never by importing this project's classes.

    pytest --pyargs cs336_systems.conformance --adapters path/to/tests/adapters.py

runs from any folder where this package is installed (its pytest11 entry point registers the plugin that
reads --adapters); without --adapters it checks this project's own implementations. On a CPU the kernels run in
Triton's interpreter and the distributed checks on gloo; the checks only a GPU can make are skipped there.
contract.py is the interface and its loader.
"""
