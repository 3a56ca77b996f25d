"""Shared fixtures live in tests/fixtures/, one module per component."""

pytest_plugins = [
    "fixtures.simcuda",
    "fixtures.scheduler",
    "fixtures.interceptor",
]
