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

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

SPECS = pathlib.Path(__file__).parent / "specs"

#: name -> (platform, topology, GPU target-config file or None).
TARGETS = {
    "tpu_v5e": ("tpu", "v5e:2x4", None),
    "tpu_v5p": ("tpu", "v5p:2x2x2", None),
    "gpu_h100": ("cuda", "1x1x8", "NVIDIA_H100_80GB_HBM3.txtpb"),
    "gpu_a100": ("cuda", "1x1x8", "NVIDIA_A100_SXM4_80GB.txtpb"),
}
TPUS = ("tpu_v5e", "tpu_v5p")
GPUS = ("gpu_h100", "gpu_a100")


class Target(NamedTuple):
  name: str
  platform: str  # "tpu" or "cuda"
  mesh: Mesh     # 8 devices along one axis, "x"

  @property
  def is_tpu(self) -> bool:
    return self.platform == "tpu"


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
      platform="cuda", target_config=(SPECS / spec).read_text(),
      topology=topology)


def target(name: str) -> Target:
  """The 8-device mesh (axis "x") of target `name`; skips where its wheels
  are absent, fails where they are present and the topology is refused."""
  platform = TARGETS[name][0]
  missing = _missing(platform)
  if missing:
    pytest.skip(f"{name}: {missing}")
  try:
    topo = _topology(name)
  except Exception as e:  # noqa: BLE001 - the wheels are here: a failure is ours to see
    pytest.fail(f"{name}: get_topology_desc failed although its wheels are "
                f"installed: {type(e).__name__}: {e}")
  return Target(name, platform, Mesh(list(topo.devices), ("x",)))


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
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
  return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(source)],
                        capture_output=True, text=True, timeout=timeout, env=env)
