"""The HLO a profile carries: each module's compiled, scheduled `Hlo Proto`.

The profile's `/host:metadata` plane has an event metadata entry per module
(named `jit_step(4)`: the module and its program id) with a stat `Hlo Proto`,
a serialized `xla.HloProto` whose field 1 is the `HloModuleProto`.
`ProfileData` does not expose it, so `wire.py` reads it. jaxlib turns the
module proto into HLO text, which the dump reader (`reading/hlo_text.py`)
parses: one reader for dumps, live compiles and profiles.

Only a proto written by the running jaxlib is converted (the capture's
`jaxlib_version` stat says which wrote it): converting an older one ran a
process out of memory.
"""

from __future__ import annotations

import re
from typing import Any

from jax_overlap._src.inspection.measured import wire
from jax_overlap._src.inspection.reading.hlo_module import HloModule
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text

METADATA_PLANE = b"/host:metadata"
HLO_PROTO_STAT = "Hlo Proto"
_MODULE_KEY = re.compile(r"^(.*)\((\d+)\)$")

# XSpace.planes; XPlane.{name, event_metadata, stat_metadata, stats};
# map entries {key, value}; XEventMetadata.{name, stats};
# XStatMetadata.{id, name}; XStat.{metadata_id, ..., str_value, bytes_value}.
_SPACE_PLANES, _PLANE_NAME, _PLANE_EVENT_METADATA = 1, 2, 4
_PLANE_STAT_METADATA, _PLANE_STATS = 5, 6
_ENTRY_VALUE = 2
_EVENT_METADATA_NAME, _EVENT_METADATA_STATS = 2, 5
_STAT_METADATA_ID, _STAT_METADATA_NAME = 1, 2
_STAT_ID, _STAT_STR, _STAT_BYTES = 1, 5, 6
_STAT_VALUES = {2: "double", 3: "uint64", 4: "int64", 5: "str", 6: "bytes",
                7: "ref"}
_HLO_PROTO_MODULE = 1


def embedded_hlo(space: bytes) -> tuple[dict[tuple[str, int | None], bytes],
                                        dict[str, Any]]:
  """({(module, program id): HloProto bytes}, the metadata plane's stats)."""
  for plane in wire.messages(space, _SPACE_PLANES):
    if wire.first(plane, _PLANE_NAME, b"") != METADATA_PLANE:
      continue
    names = {}
    for entry in wire.messages(plane, _PLANE_STAT_METADATA):
      meta = wire.first(entry, _ENTRY_VALUE, b"")
      names[wire.first(meta, _STAT_METADATA_ID, 0)] = _text(
          wire.first(meta, _STAT_METADATA_NAME, b""))
    stats = {}
    for stat in wire.messages(plane, _PLANE_STATS):
      name, value = _stat(stat, names)
      stats[name] = _text(value) if isinstance(value, bytes) else value
    protos = {}
    for entry in wire.messages(plane, _PLANE_EVENT_METADATA):
      meta = wire.first(entry, _ENTRY_VALUE, b"")
      key = _module_key(_text(wire.first(meta, _EVENT_METADATA_NAME, b"")))
      for stat in wire.messages(meta, _EVENT_METADATA_STATS):
        name, value = _stat(stat, names)
        if name == HLO_PROTO_STAT and isinstance(value, bytes):
          protos[key] = value
    return protos, stats
  return {}, {}


def running_jaxlib() -> str:
  import jaxlib.version  # noqa: PLC0415
  return jaxlib.version.__version__


def readable(stats: dict[str, Any]) -> bool:
  """Whether the running jaxlib wrote these protos (so may convert them)."""
  return stats.get("jaxlib_version") == running_jaxlib()


def module_from_hlo_proto(hlo_proto: bytes, source: str) -> HloModule:
  """Our module of a serialized `HloProto`, through its HLO text. Raises
  `ValueError` when jaxlib cannot read it, `HloParseError` when we cannot."""
  from jax._src.lib import xla_client  # noqa: PLC0415
  module_proto = wire.first(hlo_proto, _HLO_PROTO_MODULE)
  if not isinstance(module_proto, bytes):
    raise ValueError("the HLO proto holds no module")
  try:
    text = xla_client.XlaComputation(module_proto).as_hlo_text()
  except Exception as e:  # jaxlib raises its own error types
    raise ValueError(f"jaxlib cannot read the HLO proto: {e}") from None
  return parse_hlo_text(text, source=source)


def _module_key(name: str) -> tuple[str, int | None]:
  match = _MODULE_KEY.match(name)
  return (match.group(1), int(match.group(2))) if match else (name, None)


def _stat(stat: bytes, names: dict[int, str]) -> tuple[str, Any]:
  name, value = "", None
  for number, _, v in wire.fields(stat):
    if number == _STAT_ID:
      name = names.get(v, str(v))
    elif number in _STAT_VALUES:
      value = names.get(v) if number == 7 else v
  return name, value


def _text(value: bytes) -> str:
  return value.decode("utf-8", "replace")
