"""`make test-aot-jaxX` (jax < 0.12) sets JAX_OVERLAP_AOT_SUBSET=older: only
real_compilers_test's OLDER_JAX_SUBSET on OLDER_JAX_TARGETS is collected."""

import os
import pathlib
import sys

# real_compilers_test compiles tests/ordering/schedule_test.py's bodies.
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "ordering"))


def pytest_collection_modifyitems(config, items):
  if os.environ.get("JAX_OVERLAP_AOT_SUBSET") != "older":
    return
  keep, drop = [], []
  for item in items:
    module = item.module
    subset = getattr(module, "OLDER_JAX_SUBSET", set())
    targets = getattr(module, "OLDER_JAX_TARGETS", ())
    params = getattr(getattr(item, "callspec", None), "params", {})
    wanted = (item.originalname in subset
              and params.get("name", targets[0] if targets else None) in targets)
    (keep if wanted else drop).append(item)
  config.hook.pytest_deselected(items=drop)
  items[:] = keep
