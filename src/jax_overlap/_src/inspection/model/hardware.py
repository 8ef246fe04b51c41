"""Hardware profiles: the figures the cost model turns flops and bytes into time.

Built-in profiles (`tpu-v5e`, `tpu-v5p`, `h100`, `a100`) come from public
spec sheets, and where a chip was measured, from what it achieved
(`profiles.toml` beside this file says which). A user's own profile is a
small TOML or JSON file with the same keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import tomllib
from typing import Any, Mapping

from jax_overlap._src.inspection.errors import HardwareProfileError
from jax_overlap._src.inspection.model.matmul_class import CLASSES

DEFAULT_PROFILE = "h100"
#: The profile a dump is modelled on when none is named, by the platform its
#: text says it was compiled for (`reading/platform.py`); the dump does not
#: say which chip, so the one the real TPU fixtures are compiled for.
PLATFORM_PROFILES = {"tpu": "tpu-v5e", "gpu": "h100"}
_BUILTIN_FILE = pathlib.Path(__file__).with_name("profiles.toml")
_NUMBERS = {
    "peak_tflops": "dense bf16 TFLOP/s of one chip",
    "hbm_gbytes_per_s": "HBM bandwidth of one chip, GB/s",
    "interconnect_gbytes_per_s":
        "what one chip sends in one direction over the interconnect, GB/s",
    "collective_latency_us": "fixed cost of one collective, microseconds",
}
_OPTIONAL_NUMBERS = {
    "copy_gbytes_per_s": "bandwidth of an async copy, GB/s (default: half "
                         "the HBM bandwidth, a read and a write)",
    "achieved_hbm_gbytes_per_s":
        "HBM bandwidth a memory-bound op achieves, GB/s (default: "
        "hbm_gbytes_per_s)",
}
_TABLES = {
    "matmul_tflops": "achieved dense matmul TFLOP/s by operand class (" +
                     ", ".join(CLASSES) + "; a class not given runs at "
                     "peak_tflops)",
}
_TEXTS = {"name": "the profile's name", "description": "a longer name",
          "source": "where the figures come from",
          "achieved_source": "where the achieved figures come from"}
#: Short names of the built-in profiles, each naming one profile.
ALIASES = {"v5e": "tpu-v5e", "v5litepod": "tpu-v5e", "tpuv5lite": "tpu-v5e",
           "v5p": "tpu-v5p", "h100sxm": "h100", "a100sxm": "a100"}


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """The figures of one chip, for a modelled (not measured) timeline.

  Attributes:
    name: short name ('h100').
    peak_tflops: dense bf16 TFLOP/s.
    hbm_gbytes_per_s: HBM bandwidth, GB/s.
    interconnect_gbytes_per_s: one direction of the chip's interconnect, GB/s.
    collective_latency_us: fixed cost added to every collective, us.
    copy_gbytes_per_s: async copy bandwidth, GB/s (None: half of HBM).
    achieved_hbm_gbytes_per_s: HBM bandwidth a memory-bound op achieves,
      GB/s (None: `hbm_gbytes_per_s`).
    matmul_tflops: achieved dense matmul TFLOP/s by operand class
      (`matmul_class.CLASSES`: 'bf16', 'f32', 'f32-high', 'f32-highest',
      'f8', 'int8', 'f64'); a class not given runs at `peak_tflops`.
    description: a longer name.
    source: where the figures come from.
    achieved_source: where the achieved figures come from.

  Example:
    >>> from jax_overlap import HardwareProfile
    >>> HardwareProfile.named("H100").peak_tflops
    989.0
    >>> HardwareProfile.from_dict({"name": "mine", "peak_tflops": 100,
    ...     "hbm_gbytes_per_s": 1000, "interconnect_gbytes_per_s": 50,
    ...     "collective_latency_us": 5}).interconnect_gbytes_per_s
    50.0
  """

  name: str
  peak_tflops: float
  hbm_gbytes_per_s: float
  interconnect_gbytes_per_s: float
  collective_latency_us: float
  copy_gbytes_per_s: float | None = None
  achieved_hbm_gbytes_per_s: float | None = None
  matmul_tflops: dict[str, float] = dataclasses.field(
      default_factory=dict, hash=False)
  description: str = ""
  source: str = ""
  achieved_source: str = ""

  @staticmethod
  def builtin_names() -> list[str]:
    return list(_builtin())

  @classmethod
  def named(cls, name: str) -> HardwareProfile:
    """A built-in profile; the name is matched ignoring case, spaces, '-'
    and '_' ('TPU v5e' is 'tpu-v5e'), and a short name that names one
    profile is taken for it ('v5e', 'v5p'; `ALIASES`): the profile keeps its
    own name."""
    profiles = _builtin()
    wanted = _normalized(name)
    wanted = _normalized(ALIASES.get(wanted, wanted))
    for key, profile in profiles.items():
      if _normalized(key) == wanted or _normalized(profile.description) == wanted:
        return profile
    raise HardwareProfileError(
        f"unknown hardware {name!r}; built-in profiles are "
        f"{', '.join(profiles)} (also by their short names: "
        f"{', '.join(sorted(ALIASES))}), or pass the path of a .toml or .json "
        "profile file")

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> HardwareProfile:
    """A profile from a TOML or JSON file holding the keys of this class."""
    path = pathlib.Path(path)
    try:
      text = path.read_text(encoding="utf-8")
    except OSError as e:
      raise HardwareProfileError(
          f"cannot read hardware profile {str(path)!r} ({e.strerror or e})"
      ) from None
    try:
      if path.suffix.lower() == ".json":
        data = json.loads(text)
      else:
        data = tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
      raise HardwareProfileError(
          f"hardware profile {str(path)!r} is not valid "
          f"{'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {e}"
      ) from None
    if not isinstance(data, dict):
      raise HardwareProfileError(
          f"hardware profile {str(path)!r} must hold a table of keys, got "
          f"{type(data).__name__}")
    data = dict(data)
    data.setdefault("name", path.stem)
    return cls.from_dict(data, where=str(path))

  @classmethod
  def from_dict(cls, data: Mapping[str, Any],
                where: str = "hardware profile") -> HardwareProfile:
    """A profile from a mapping; every problem named with the key at fault."""
    known = set(_NUMBERS) | set(_OPTIONAL_NUMBERS) | set(_TABLES) | set(_TEXTS)
    unknown = sorted(set(data) - known)
    if unknown:
      raise HardwareProfileError(
          f"{where}: unknown key {unknown[0]!r}; the keys are "
          f"{', '.join(sorted(known))}")
    missing = [k for k in list(_NUMBERS) + ["name"] if k not in data]
    if missing:
      raise HardwareProfileError(
          f"{where}: missing {missing[0]!r} "
          f"({(_NUMBERS | _TEXTS)[missing[0]]}); add it")
    values: dict[str, Any] = {}
    for key, meaning in (_NUMBERS | _OPTIONAL_NUMBERS).items():
      if key not in data:
        continue
      value = data[key]
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HardwareProfileError(
            f"{where}: {key} must be a number ({meaning}), got {value!r}")
      positive = key != "collective_latency_us"
      if value < 0 or (positive and value == 0) or value != value:
        raise HardwareProfileError(
            f"{where}: {key} must be {'> 0' if positive else '>= 0'} "
            f"({meaning}), got {value!r}")
      values[key] = float(value)
    if "matmul_tflops" in data:
      values["matmul_tflops"] = _rates(data["matmul_tflops"], where)
    for key in _TEXTS:
      if key in data:
        if not isinstance(data[key], str):
          raise HardwareProfileError(
              f"{where}: {key} must be a string ({_TEXTS[key]}), got "
              f"{data[key]!r}")
        values[key] = data[key]
    return cls(**values)

  def matmul_rate(self, matmul_class: str) -> float:
    """Achieved TFLOP/s of a matmul of `matmul_class`, else `peak_tflops`."""
    return self.matmul_tflops.get(matmul_class, self.peak_tflops)

  @property
  def memory_gbytes_per_s(self) -> float:
    """The HBM bandwidth memory-bound work is modelled at."""
    return self.achieved_hbm_gbytes_per_s or self.hbm_gbytes_per_s

  def describe(self) -> str:
    achieved = ""
    if self.matmul_tflops:
      achieved = " (matmuls: " + ", ".join(
          f"{k} {v:g}" for k, v in self.matmul_tflops.items()) + ")"
    hbm = f"HBM {self.hbm_gbytes_per_s:g} GB/s"
    if self.achieved_hbm_gbytes_per_s:
      hbm += f" (achieved {self.achieved_hbm_gbytes_per_s:g})"
    return (f"{self.description or self.name}: {self.peak_tflops:g} TFLOP/s"
            f"{achieved}, {hbm}, interconnect "
            f"{self.interconnect_gbytes_per_s:g} GB/s one way, "
            f"{self.collective_latency_us:g} us a collective")


def _rates(table, where: str) -> dict[str, float]:
  """A profile's `matmul_tflops` table, each class and rate checked."""
  meaning = _TABLES["matmul_tflops"]
  if not isinstance(table, Mapping):
    raise HardwareProfileError(
        f"{where}: matmul_tflops must be a table ({meaning}), got {table!r}")
  rates = {}
  for key, value in table.items():
    if key not in CLASSES:
      raise HardwareProfileError(
          f"{where}: matmul_tflops has unknown class {key!r}; the classes are "
          f"{', '.join(CLASSES)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
        or not value > 0:
      raise HardwareProfileError(
          f"{where}: matmul_tflops.{key} must be a number > 0 (achieved "
          f"TFLOP/s of {CLASSES[key]}), got {value!r}")
    rates[key] = float(value)
  return rates


def resolve_hardware(hardware) -> HardwareProfile:
  """A profile from what a user passed: None (the default), a profile, a
  mapping, a built-in name, or the path of a .toml/.json file."""
  if hardware is None:
    return HardwareProfile.named(DEFAULT_PROFILE)
  if isinstance(hardware, HardwareProfile):
    return hardware
  if isinstance(hardware, Mapping):
    return HardwareProfile.from_dict(hardware)
  if isinstance(hardware, os.PathLike):
    return HardwareProfile.from_file(hardware)
  if isinstance(hardware, str):
    if hardware.lower().endswith((".toml", ".json")) or os.sep in hardware:
      return HardwareProfile.from_file(hardware)
    return HardwareProfile.named(hardware)
  raise HardwareProfileError(
      f"hardware must be None, a name ({', '.join(_builtin())}), a profile "
      f"file path or a HardwareProfile; got {type(hardware).__name__}")


def default_for_platform(platform: str | None) -> HardwareProfile:
  """The profile for a module compiled for `platform` ('tpu', 'gpu'; None
  where the module does not say): `PLATFORM_PROFILES`, else h100."""
  return HardwareProfile.named(PLATFORM_PROFILES.get(platform, DEFAULT_PROFILE))


_CACHE: dict[str, HardwareProfile] = {}


def _builtin() -> dict[str, HardwareProfile]:
  if not _CACHE:
    # Built whole, then kept: a read that fails part-way leaves no half table
    # for a later call to take as the full one.
    data = tomllib.loads(_BUILTIN_FILE.read_text(encoding="utf-8"))
    profiles = {key: HardwareProfile.from_dict(
        {"name": key, **table}, where=f"built-in profile {key!r}")
        for key, table in data.items()}
    _CACHE.update(profiles)
  return _CACHE


def _normalized(name: str) -> str:
  return re.sub(r"[\s_\-]", "", name.lower())
