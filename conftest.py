from hypothesis import settings

pytest_plugins = ["cs336_systems.pytest_plugin", "pytester"]

# No property test has a time limit: a per-example deadline is a wall-clock assertion, and it fails
# on a loaded machine (two suites sharing two cores) while the property holds.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")
