"""Which mesh axes a compiled collective runs over, read from its groups.

A scheduled SPMD module names devices by partition id, the flat index into
the mesh's devices. A collective's groups (`replica_groups`, explicit
`{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[4,2]<=[2,2,2]T(0,2,1)`, or the mesh
form that names its axes, `mesh['fsdp'=4,'tp'=2] {'tp'}`) or a
permute's `source_target_pairs` then say which mesh coordinates differ within
a group: those are its axes. On TPU an async collective can be a fusion
chain whose start holds the collective inside the computation it calls;
that inner instruction's groups are read.
"""

from __future__ import annotations

import re

import numpy as np

import schedule

_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_MESH = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")


def named_axes(line: str) -> frozenset | None:
  """The axes a collective's mesh-form groups name
  (`replica_groups=mesh['pp'=2,'tp'=4] {'tp'}`), or None."""
  m = _MESH.search(line)
  return frozenset(re.findall(r"'([^']*)'", m.group(1))) if m else None


def groups_of(line: str) -> list[tuple[int, ...]] | None:
  """The device groups of one HLO instruction line (a permute's pairs are
  groups of two), or None if it names none."""
  m = _PAIRS.search(line)
  if m:
    return [tuple(map(int, g)) for g in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  m = _IOTA.search(line)
  if m:
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return [tuple(g) for g in ids.reshape(shape).tolist()]
  m = _EXPLICIT.search(line)
  if m:
    return [tuple(int(v) for v in g.split(",") if v)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return None


def axes_of(groups, shape: tuple[int, ...], names: tuple[str, ...]) -> frozenset:
  """The mesh axes along which the devices of some group differ."""
  coords = lambda d: np.unravel_index(d, shape)
  out = set()
  for g in groups:
    cs = [coords(d) for d in g]
    out |= {names[i] for i in range(len(shape)) if len({c[i] for c in cs}) > 1}
  return frozenset(out)


def window_axes(text: str, window: schedule.Window, shape, names) -> frozenset | None:
  """The mesh axes of `window`'s collective (None if its groups are not found)."""
  comps = schedule.computations(text)
  todo = [schedule.scheduled(text)[window.computation][window.start]]
  seen = set()
  while todo:
    instr = todo.pop()
    named = named_axes(instr.line)
    if named is not None:
      return named
    groups = groups_of(instr.line)
    if groups is not None:
      return axes_of(groups, shape, names)
    for callee in re.findall(r"\b(?:calls|to_apply)=%([\w.\-]+)", instr.line):
      if callee not in seen:
        seen.add(callee)
        todo += comps.get(callee, [])
  return None
