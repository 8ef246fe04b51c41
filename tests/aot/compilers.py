"""The real TPU and GPU compilers, run ahead of time on a machine with neither.

`jax.experimental.topologies.get_topology_desc` describes a TPU slice (libtpu)
or a set of GPUs (the CUDA plugin, with an XLA `GpuTargetConfigProto`), and a
function lowered on `ShapeDtypeStruct`s sharded over its devices compiles with
that backend's own compiler. Nothing runs: `compiled_text` returns the
scheduled module (`compile().as_text()`), which is what these tests read.

Both backends work in one process, provided `JAX_PLATFORMS=cpu` is set before
jax is imported (tests/conftest.py does; otherwise the CUDA plugin fails at
`cuInit` and never registers). Where the wheels are absent (`make test-aot`
installs them into .venv-aot) `target(...)` skips, naming what is missing.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, Callable, NamedTuple, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata-server lookup
# libtpu takes /tmp/libtpu_lockfile for the chips of this host; there are none,
# and without this a second process compiling for TPU (another test run, the
# subprocess of compile_in_subprocess) fails with "multi-process lockfile".
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

#: XLA's GPU target configs, shipped with the package for jax_overlap.testing.
SPECS = (pathlib.Path(__file__).parents[2] / "src" / "jax_overlap" / "_src"
         / "testing" / "gpu_specs")

#: name -> (platform, topology, GPU target-config file or None). GPU
#: topologies are "partitions x hosts x GPUs per host": "1x2x8" is 16 GPUs on
#: two hosts (devices 8-15 have process_index 1).
TARGETS = {
    "tpu_v5e": ("tpu", "v5e:2x4", None),
    "tpu_v5p": ("tpu", "v5p:2x2x2", None),
    "gpu_h100": ("cuda", "1x1x8", "NVIDIA_H100_80GB_HBM3.txtpb"),
    "gpu_a100": ("cuda", "1x1x8", "NVIDIA_A100_SXM4_80GB.txtpb"),
    "gpu_h100_2x8": ("cuda", "1x2x8", "NVIDIA_H100_80GB_HBM3.txtpb"),
    "gpu_a100_2x8": ("cuda", "1x2x8", "NVIDIA_A100_SXM4_80GB.txtpb"),
}
TPUS = ("tpu_v5e", "tpu_v5p")
GPUS = ("gpu_h100", "gpu_a100", "gpu_h100_2x8", "gpu_a100_2x8")


class Target(NamedTuple):
  name: str
  platform: str  # "tpu" or "cuda"
  mesh: Mesh     # every device of the topology along one axis, "x"

  @property
  def is_tpu(self) -> bool:
    return self.platform == "tpu"

  @property
  def n(self) -> int:
    return self.mesh.devices.size


def _missing(platform: str) -> str | None:
  """What is missing for `platform`'s compiler here, or None."""
  import importlib.util  # noqa: PLC0415
  if platform == "tpu" and importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed (make test-aot installs it in .venv-aot)"
  if platform == "cuda":
    for module in ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"):
      try:
        found = importlib.util.find_spec(module)
      except ModuleNotFoundError:
        found = None
      if found is None:
        return (f"{module} is not installed (jax-cuda12-plugin, jax-cuda12-pjrt "
                "and nvidia-cuda-nvcc-cu12; make test-aot installs them in .venv-aot)")
  return None


@functools.cache
def _topology(name: str):
  from jax.experimental import topologies  # noqa: PLC0415
  platform, topology, spec = TARGETS[name]
  if platform == "tpu":
    return topologies.get_topology_desc(topology_name=topology, platform="tpu")
  return topologies.get_topology_desc(
      platform="cuda", target_config=spec_file(spec).read_text(),
      topology=topology)


def spec_file(spec: str) -> pathlib.Path:
  """`spec`, or its copy for this jax where the plugin's proto is older
  (`<stem>.jax<version>.txtpb`: fields it does not know removed,
  gpu_specs/README.md)."""
  own = SPECS / spec.replace(".txtpb", f".jax{jax.__version__}.txtpb")
  return own if own.exists() else SPECS / spec


def target(name: str, explicit: bool = False) -> Target:
  """The mesh (axis "x", all devices) of target `name`, with an Explicit
  axis type if `explicit`; skips where its wheels are absent, fails where
  they are present and the topology is refused."""
  platform = TARGETS[name][0]
  missing = _missing(platform)
  if missing:
    pytest.skip(f"{name}: {missing}")
  try:
    topo = _topology(name)
  except Exception as e:  # noqa: BLE001 - the wheels are here: a failure is ours to see
    pytest.fail(f"{name}: get_topology_desc failed although its wheels are "
                f"installed: {type(e).__name__}: {e}")
  if explicit:
    if not hasattr(jax.sharding, "AxisType"):
      pytest.skip(f"jax {jax.__version__} has no jax.sharding.AxisType")
    mesh = Mesh(list(topo.devices), ("x",),
                axis_types=(jax.sharding.AxisType.Explicit,))
  else:
    mesh = Mesh(list(topo.devices), ("x",))
  return Target(name, platform, mesh)


def arg(target_: Target, shape: Sequence[int], spec: P = P(), dtype=None):
  """An abstract argument laid out over `target_`'s mesh."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype or jax.numpy.float32,
                              sharding=NamedSharding(target_.mesh, spec))


def compiled_text(fn: Callable, *args: Any, compiler_options=None) -> str:
  """The scheduled module `fn` compiles to for the args' target."""
  lowered = jax.jit(fn).lower(*args)
  return lowered.compile(compiler_options=compiler_options).as_text()


def compile_in_subprocess(source: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs `source` (which may use this module's names) in a fresh Python.

  For programs that have crashed a compiler: a SIGSEGV then fails a test
  instead of killing pytest. The source prints what the test checks.
  """
  prelude = textwrap.dedent(f"""\
      import sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      from compilers import *
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(source)],
                        capture_output=True, text=True, timeout=timeout, env=env)
