"""Every test here is `newest_jax` (tests/conftest.py): on older jax
(`make test-aot-jaxX`, jax 0.10.2 / 0.11.0) only the tests a module names in
its own `newest_jax(older_jax=[...])` marker run (real_compilers_test's
subset: the written order, the five futures and fsdp_scan on TPU v5e and GPU
H100); the rest skip, saying so."""

import pathlib
import sys

import pytest

# real_compilers_test compiles tests/ordering/schedule_test.py's bodies.
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "ordering"))

HERE = pathlib.Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py reads the markers
def pytest_collection_modifyitems(config, items):
  for item in items:
    if HERE in item.path.parents and item.get_closest_marker("newest_jax") is None:
      item.add_marker(pytest.mark.newest_jax)
