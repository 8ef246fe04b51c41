"""The real compilers `jax_overlap.testing` compiles for, ahead of time.

A target names a topology that `jax.experimental.topologies` describes with
no accelerator present: libtpu compiles for a TPU slice, the CUDA plugin for
a set of GPUs described by one of XLA's GPU target configs (copies ship in
`gpu_specs/`). Nothing runs; the compile and its schedule are real
(tests/aot/ compiles the library's own programs this way).

Pinned by tests/aot/testing_compiled_test.py (each target compiles) and
tests/inspection/testing_test.py (a missing compiler is named, with what to
install).

Example:
  >>> from jax_overlap._src.testing.targets import resolve_target
  >>> t = resolve_target("TPU_v5e")
  >>> t.name, t.platform, t.topology, t.profile
  ('tpu-v5e', 'tpu', 'v5e:2x4', 'tpu-v5e')
  >>> resolve_target("gpu-h100:1x2x8").topology
  '1x2x8'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib

import jax

SPECS = pathlib.Path(__file__).with_name("gpu_specs")


class CompilerNotFoundError(RuntimeError):
  """The real compiler of a `jax_overlap.testing` target cannot run here:
  its package is not installed (the message says which, and how), or it is
  installed but did not register with jax."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A topology to compile for. `platform` is 'tpu' or 'cuda'; `topology`
  is libtpu's name ('v5e:2x4') or the CUDA plugin's 'partitions x hosts x
  GPUs per host' ('1x1x8'); `spec` the GPU target config's file name;
  `profile` the hardware profile its report is modelled on."""

  name: str
  platform: str
  topology: str
  spec: str | None
  profile: str


#: The targets, with their default topologies (8 devices each).
TARGETS = {t.name: t for t in (
    Target("tpu-v5e", "tpu", "v5e:2x4", None, "tpu-v5e"),
    Target("tpu-v5p", "tpu", "v5p:2x2x2", None, "tpu-v5p"),
    Target("gpu-h100", "cuda", "1x1x8", "NVIDIA_H100_80GB_HBM3.txtpb", "h100"),
    Target("gpu-a100", "cuda", "1x1x8", "NVIDIA_A100_SXM4_80GB.txtpb", "a100"),
)}


def resolve_target(target) -> Target:
  """A `Target` from its name ('tpu-v5e', 'gpu-h100', ...; case, '_' and
  ' ' as '-'), with an optional topology after a colon ('tpu-v5e:4x4',
  'gpu-h100:1x2x8')."""
  if isinstance(target, Target):
    return target
  if not isinstance(target, str):
    raise TypeError(f"target must be a name ({', '.join(TARGETS)}), got "
                    f"{type(target).__name__}")
  name, _, topology = target.partition(":")
  key = name.strip().lower().replace("_", "-").replace(" ", "-")
  if key not in TARGETS:
    raise ValueError(
        f"target={target!r} is not a known target; the targets are "
        f"{', '.join(TARGETS)} (a topology may follow a colon: "
        "'tpu-v5e:4x4', 'gpu-h100:1x2x8')")
  if not topology.strip():
    return TARGETS[key]
  return dataclasses.replace(TARGETS[key], topology=topology.strip())


def missing(platform: str) -> str | None:
  """What to install for `platform`'s compiler, or None when it is here."""
  if platform == "tpu":
    if _found("libtpu"):
      return None
    return ("the real TPU compiler, libtpu, is not installed: `pip install "
            "libtpu` (Linux x86-64; no TPU needed)")
  absent = [m for m in ("jax_plugins.xla_cuda12", "nvidia.cuda_nvcc")
            if not _found(m)]
  if not absent:
    return None
  v = jax.__version__
  return (f"the real GPU compiler is not installed ({', '.join(absent)} not "
          f"found): `pip install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} "
          "nvidia-cuda-nvcc-cu12` (Linux x86-64; no GPU needed), and set "
          "JAX_PLATFORMS=cpu before jax is imported")


def _found(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:   # its parent package is absent
    return False


def devices(target) -> list:
  """The devices of `target`'s topology (raises `CompilerNotFoundError`)."""
  return list(_topology(resolve_target(target)).devices)


@functools.cache
def _topology(t: Target):
  why = missing(t.platform)
  if why:
    raise CompilerNotFoundError(f"target {t.name!r}: {why}.")
  from jax.experimental import topologies  # noqa: PLC0415
  if t.platform == "tpu":
    # No metadata server to ask, and no chips of this host to lock.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
      return topologies.get_topology_desc(topology_name=t.topology,
                                          platform="tpu")
    except Exception as e:  # noqa: BLE001 - said with the target's name
      raise CompilerNotFoundError(
          f"target {t.name!r}: libtpu is installed but refused topology "
          f"{t.topology!r}: {type(e).__name__}: {e}") from None
  return _gpu_topology(t, topologies)


def _gpu_topology(t: Target, topologies):
  errors = []
  for config in gpu_configs(t.spec):
    try:
      return topologies.get_topology_desc(
          platform="cuda", target_config=config.read_text(),
          topology=t.topology)
    except Exception as e:  # noqa: BLE001 - the next copy, or said below
      errors.append(f"{type(e).__name__}: {e}")
      if "parse" not in str(e).lower() and "no field named" not in str(e):
        break   # not the proto's age: another copy will not help
  hint = ""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
    hint = (" On a machine without a GPU the plugin registers only when "
            "JAX_PLATFORMS=cpu is set before jax is imported (for pytest, at "
            "the top of conftest.py); else it fails at cuInit.")
  raise CompilerNotFoundError(
      f"target {t.name!r}: the CUDA plugin is installed but refused topology "
      f"{t.topology!r}: {errors[0] if errors else 'no target config'}.{hint}")


def gpu_configs(spec: str) -> list[pathlib.Path]:
  """`spec` and then its copies with fields an older plugin's proto lacks
  (gpu_specs/README.md), to try in turn."""
  stem = spec.removesuffix(".txtpb")
  return [SPECS / spec] + sorted(p for p in SPECS.glob(f"{stem}.*.txtpb"))
