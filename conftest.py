pytest_plugins = ["cs336_systems.pytest_plugin", "pytester"]
