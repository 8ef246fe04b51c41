"""Reading instruction attributes: backend configs, trip counts, replica groups.

Each reader takes the raw attribute text the parser kept and returns None (or
an empty value) where the attribute is absent or in a form we do not read:
the report then says what it could not know rather than guessing.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jax_overlap._src.inspection.reading import lexing
from jax_overlap._src.inspection.reading.hlo_module import HloInstruction, HloModule
from jax_overlap._src.patterns.leaf_scope import leaf_from_op_name, step_from_op_name

_IOTA_GROUPS = re.compile(r"\[([\d,\s]+)\]<=\[[\d,\s]+\](T\([\d,\s]+\))?")
_MESH_GROUPS = re.compile(r"mesh\[(.*)\]\s*\{(.*)\}")


def backend_config(instr: HloInstruction) -> dict[str, Any]:
  """The backend config as a dict: JSON, or JSON in an escaped string.
  {} for anything else (absent, a serialized proto)."""
  value = instr.attributes.get("backend_config", "").strip()
  if value.startswith('"'):
    try:
      value = lexing.unquote(value).strip()
    except ValueError:
      return {}
  if not value.startswith("{"):
    return {}
  try:
    config = json.loads(value)
  except ValueError:
    return {}
  return config if isinstance(config, dict) else {}


def known_trip_count(instr: HloInstruction) -> int | None:
  """A while loop's trip count: XLA's `known_trip_count` from its backend
  config, else what its condition says (`trip_counts.py`, set by the reader
  on the instruction), else None."""
  count = backend_config(instr).get("known_trip_count")
  if count is None:
    return instr.trip_count
  if isinstance(count, dict):
    count = count.get("n")
  try:
    count = int(count) if count is not None else None
  except (TypeError, ValueError, OverflowError):
    return None
  return count if count is None or count >= 0 else None


def frontend_attributes(instr: HloInstruction) -> dict[str, str]:
  """`frontend_attributes={k="v", ...}` as a dict of strings."""
  value = instr.attributes.get("frontend_attributes", "").strip()
  if not value.startswith("{"):
    return {}
  out = {}
  try:
    for piece in lexing.split_top_level(value[1:-1]):
      key, _, raw = piece.partition("=")
      raw = raw.strip()
      out[key.strip()] = lexing.unquote(raw) if raw.startswith('"') else raw
  except ValueError:
    return {}
  return out


def string_attribute(instr: HloInstruction, key: str) -> str | None:
  """A quoted attribute (e.g. `custom_call_target`, `async_execution_thread`)."""
  value = instr.attributes.get(key)
  if value is None:
    return None
  try:
    return lexing.unquote(value)
  except ValueError:
    return value.strip()


def op_name(instr: HloInstruction) -> str:
  """`metadata={op_name="..."}`, '' when absent."""
  value = instr.attributes.get("metadata", "")
  m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', value)
  return m.group(1) if m else ""


def leaf(instr: HloInstruction) -> str | None:
  """What a pattern's collective moves (e.g. "['w1']"), from the
  `jax_overlap.leaf=` scope in its op_name; None when it does not say."""
  name = _unquoted_op_name(instr)
  return None if name is None else leaf_in(name)


def step(instr: HloInstruction) -> str | None:
  """The plan step a pattern started this collective in (e.g. "forward:
  layer 1 to layer 3 (one loop)"), from the `jax_overlap.step=` scope in its
  op_name; None when it does not say."""
  name = _unquoted_op_name(instr)
  return None if name is None else step_in(name)


def step_in(op_name: str) -> str | None:
  """The innermost `jax_overlap.step=` label in `op_name`, read as `leaf_in`
  reads leaves (inside transformations' parentheses too)."""
  return step_from_op_name(_without_transforms(op_name))


def _unquoted_op_name(instr: HloInstruction) -> str | None:
  try:
    return lexing.unquote(f'"{op_name(instr)}"')
  except ValueError:
    return None


_TRANSFORMS = re.compile(r"^(?:[\w.\-]+\()+")


def leaf_in(op_name: str) -> str | None:
  """The innermost `jax_overlap.leaf=` name in `op_name`, also where jax
  wrote the scope inside a transformation's parentheses: a future started
  in a pattern under `jax.grad` has `jvp(jax_overlap.leaf=())` or
  `transpose(jvp(jax_overlap.leaf=()))` there, so each scope loses its
  leading `name(` and the `)`s that close them (the leaf's own brackets,
  as in "()", stay balanced). Pinned by tests/integration/real_clients_report_test.py."""
  return leaf_from_op_name(_without_transforms(op_name))


def _without_transforms(op_name: str) -> str:
  """`op_name` with each scope's transformation wrappers (`jvp(`, `transpose(`
  and their closing `)`s) taken off."""
  scopes = []
  for scope in op_name.split("/"):
    scope = _TRANSFORMS.sub("", scope)
    depth = scope.count("(") - scope.count(")")
    while depth < 0 and scope.endswith(")"):
      scope, depth = scope[:-1], depth + 1
    scopes.append(scope)
  return "/".join(scopes)


def source_location(instr: HloInstruction,
                    module: HloModule | None = None) -> str | None:
  """`file:line` from `metadata={... source_file="..." source_line=N}`, or
  from its `stack_frame_id=N` and `module`'s stack-frame tables (the dumps
  of every supported jax; `stack_frames.py`); None when neither says."""
  value = instr.attributes.get("metadata", "")
  file = re.search(r'source_file=("(?:[^"\\]|\\.)*")', value)
  line = re.search(r"source_line=(\d+)", value)
  if not file or not line:
    frame = re.search(r"stack_frame_id=(\d+)", value)
    frames = getattr(module, "stack_frames", None)
    if frame and frames is not None:
      return frames.location(int(frame.group(1)))
    return None
  try:
    return f"{lexing.unquote(file.group(1))}:{line.group(1)}"
  except ValueError:
    return None


def integer_list(value: str | None) -> list[int]:
  """`{1,0}` or `1` as a list of ints ([] when absent or unreadable)."""
  if not value:
    return []
  try:
    return [int(v) for v in value.strip().strip("{}").split(",") if v.strip()]
  except ValueError:
    return []


def group_size(instr: HloInstruction, module: HloModule) -> int | None:
  """How many devices take part in one group of a collective.

  Reads `replica_groups` in its explicit (`{{0,1},{2,3}}`), iota
  (`[2,4]<=[8]`) and mesh (`mesh['x'=2,'y'=4] {'y'}`) forms, and the pairs of
  a permute or send/recv. Empty groups mean every device (partitions times
  replicas from the module header). None when nothing says.
  """
  pairs = source_target_pairs(instr)
  if pairs:
    return len({d for pair in pairs for d in pair})
  value = instr.attributes.get("replica_groups")
  if value is None:
    return module.num_devices if module.num_devices > 1 else None
  value = value.strip()
  m = _IOTA_GROUPS.fullmatch(value)
  if m:
    dims = [int(d) for d in m.group(1).split(",") if d.strip()]
    return dims[-1] if dims else None
  m = _MESH_GROUPS.fullmatch(value)
  if m:
    sizes = dict(re.findall(r"'([^']*)'\s*=\s*(\d+)", m.group(1)))
    axes = re.findall(r"'([^']*)'", m.group(2))
    if axes and all(a in sizes for a in axes):
      return math.prod(int(sizes[a]) for a in axes)
    return None
  if value.startswith("{"):
    inner = value[1:-1].strip()
    if not inner:
      return module.num_devices if module.num_devices > 1 else None
    first = re.match(r"\{([^}]*)\}", inner)
    if first:
      return len([d for d in first.group(1).split(",") if d.strip()])
  return None


def source_target_pairs(instr: HloInstruction) -> list[tuple[int, int]]:
  """The (source, target) pairs of a permute or of a send/recv."""
  value = instr.attributes.get("source_target_pairs")
  if value is None:
    value = frontend_attributes(instr).get(
        "_xla_send_recv_source_target_pairs")
  if not value:
    return []
  return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}",
                                                  value)]
