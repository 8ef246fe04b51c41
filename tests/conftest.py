"""Test setup: 8 virtual CPU devices, configured here and never by the user; the
mesh fixtures the folders share; the markers (registered in pyproject.toml).

Markers:
- `newest_jax`: runs on the newest jax only (CI runs the suite on every
  supported jax side by side, and its time budget holds one full copy). On
  older jax the test is skipped, naming why; `newest_jax(older_jax=[names])`
  on a module or class keeps the named tests (a test's full name, e.g.
  `test_x[a-b]`, or its name before the parameters; `*` stands for any
  characters, e.g. `test_x[*-tpu_v5e]`) on older jax too: the older-jax
  subset. tests/aot/ is `newest_jax` throughout (tests/aot/conftest.py).
- `subprocess`: starts a Python process of its own (a fresh import, a second
  process, a timeout around a crash). `-m "not subprocess"` leaves them out.
- `slow`: takes more than about 20 s on one core. `-m "not slow"` for a
  quick run.
"""

import importlib.util
import os
import pathlib
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU's LLVM backend at -O0: the tests' programs are tiny, so compiling
# costs far more than running, and -O0 cuts a compile's CPU time 2-3x. Only
# the machine code differs: the optimized HLO the tests read is the same text
# (checked on fsdp_test's transformer program). Subprocesses inherit it. Not
# in a venv with the real TPU/GPU compilers (tests/aot): theirs keep XLA's
# defaults.
_O0 = "--xla_backend_optimization_level=0"
if (not any(importlib.util.find_spec(m) for m in ("libtpu", "jax_cuda12_plugin"))
    and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_O0}".strip()

# The CUDA plugin of jax >= 0.12 (tests/aot, .venv-aot) runs XLA's fusion autotuner
# even with no GPU (its `config-assigner` pass): it compiles each loop fusion of the
# module alone, through LLVM and ptxas, to pick the native emitter's unroll factor, and
# that is half of an H100 compile's CPU time (pipeline_compiled_test's lockstep tp
# program: 164 -> 86 CPU s). Off, the scheduled module is the same instructions in the
# same order; only those fusions' `native_emitter_backend_config` annotations are gone
# (compared line by line with them stripped). The older jax's plugins have no such pass
# and keep XLA's defaults, as the TPU compiler does (the flag is GPU-only).
_NO_FUSION_AUTOTUNER = "--xla_gpu_experimental_enable_fusion_autotuner=false"


def _cuda_plugin_at_least(version: tuple[int, ...]) -> bool:
  from importlib import metadata  # noqa: PLC0415
  try:
    found = metadata.version("jax-cuda12-plugin")
  except metadata.PackageNotFoundError:
    return False
  return tuple(int(p) for p in re.findall(r"\d+", found)[:len(version)]) >= version


if (_cuda_plugin_at_least((0, 12))
    and "xla_gpu_experimental_enable_fusion_autotuner" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_FUSION_AUTOTUNER}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# tests/support/ holds the modules tests in every folder import (lowered.py,
# ragged_reference.py, meshes.py); it holds no tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent / "support"))

import meshes  # noqa: E402

from jax_overlap._src import _compat  # noqa: E402

#: The newest supported jax (0.12): the one with jax's high-level jaxprs.
NEWEST_JAX = _compat.USE_HIJAX


def _kept_on_older_jax(item, names) -> bool:
  """Whether one of `names` (a full test name, its name before the
  parameters, or either with `*` for any characters) names `item`."""
  for name in names:
    pattern = ".*".join(map(re.escape, name.split("*")))
    if any(re.fullmatch(pattern, n)
           for n in (item.name, getattr(item, "originalname", None)) if n):
      return True
  return False


def pytest_collection_modifyitems(config, items):
  if NEWEST_JAX:
    return
  reason = (f"runs on the newest jax only (jax 0.12; this is jax {jax.__version__}): "
            "CI's time budget; the older-jax subset runs here")
  for item in items:
    marks = list(item.iter_markers("newest_jax"))
    if not marks:
      continue
    kept = set().union(*(m.kwargs.get("older_jax", ()) for m in marks))
    if not _kept_on_older_jax(item, kept):
      item.add_marker(pytest.mark.skip(reason=reason))


# --- meshes ------------------------------------------------------------------------
# One-axis meshes with Auto axes, the context most tests run in; a file whose
# meshes differ (explicit axes, several axes, per-case sizes) builds its own with
# meshes.make.

@pytest.fixture(scope="session")
def mesh2():
  """2 devices, axis "i"."""
  return meshes.make((2,), ("i",))


@pytest.fixture(scope="session")
def mesh8():
  """8 devices, axis "i"."""
  return meshes.make((8,), ("i",))


# --- shared compiles ------------------------------------------------------------------
# `shared_compiles` (module scope; a file opts in with
# `pytestmark = pytest.mark.usefixtures("shared_compiles")`): jax's own
# persistent compilation cache, in a directory of the module's, for the
# module's tests. An eager shard_map compiles each op alone, the same small
# programs cell after cell; a cached executable is one compile of the same
# module text and compile options (ours included: they are in jax's key), so
# the values are the same. The cache is off again after the module: a test
# that counts or watches compiles never sees it, nor does a subprocess
# (compile_hook_test::test_compiles_are_not_cached_here pins it).

@pytest.fixture(scope="module")
def shared_compiles(tmp_path_factory):
  from jax._src import compilation_cache  # noqa: PLC0415
  settings = {"jax_compilation_cache_dir": str(tmp_path_factory.mktemp("compiles")),
              "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": -1}
  before = {name: getattr(jax.config, name) for name in settings}

  def use(values):
    for name, value in values.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()  # jax decides once a process whether to use it

  use(settings)
  yield
  use(before)


# --- CPU seconds a test (for CI's time budget) ------------------------------------
# With JAX_OVERLAP_CPU_LOG=DIR each test process appends "SECONDS NODEID" lines to
# DIR/cpu-PID.txt: the process's user + system CPU seconds over the test's setup, call
# and teardown, its finished subprocesses' included. Wall-clock durations (--durations)
# on a shared 2-core CI machine mostly measure the other lanes; CPU seconds add up to
# what the run costs.
_CPU_LOG = os.environ.get("JAX_OVERLAP_CPU_LOG")


def _cpu_now() -> float:
  import resource  # noqa: PLC0415
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_LOG:
  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    began = _cpu_now()
    yield
    spent = _cpu_now() - began
    path = pathlib.Path(_CPU_LOG)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"cpu-{os.getpid()}.txt", "a") as f:
      f.write(f"{spent:.2f} {item.nodeid}\n")
