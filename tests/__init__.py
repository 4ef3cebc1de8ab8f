"""The test suite (a regular package, so no stray top-level `tests` package installed by a
dependency, such as the one verl 0.9.1's wheel ships, can shadow it)."""
