"""Reading a scheduled module (`compile().as_text()`) of the TPU or GPU compiler.

Each scheduled computation lists its instructions in schedule order. An async
collective is a `X-start` and, later, the `X-done` that depends on it (on TPU
possibly a chain of fusions: start, continuations, done), paired by the
library's inspector; its window is what is scheduled between them. A matmul
is an instruction whose metadata names a `dot_general` (GPU: a gemm fusion
or cuBLAS call; TPU: a convolution fusion).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
from jax_overlap._src.inspection.schedule.pairing import read_schedule

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][a-z0-9\-]*)\((.*)$")


class Instr(NamedTuple):
  name: str
  opcode: str
  operands: tuple[str, ...]
  line: str

  @property
  def is_matmul(self) -> bool:
    return bool(re.search(r'op_name="[^"]*dot_general', self.line))


def computations(text: str) -> dict[str, list[Instr]]:
  """Computation name -> its instructions in order ("ENTRY" for the entry).

  A module is parsed once (the last few are kept): a caller asking again for
  the same text, as `mesh_axes.window_axes` does once a window, gets a fresh
  copy of the same lists (a 4-block model's module, 5.5 MB, took 0.4 s a
  parse, 107 parses for llama_4d_compiled_test's H100 pp_fsdp_cp)."""
  return {k: list(v) for k, v in _computations(text).items()}


def scheduled(text: str) -> dict[str, list[Instr]]:
  """The computations that carry a schedule: the entry and while bodies."""
  return {k: list(v) for k, v in _scheduled(text).items()}


@functools.lru_cache(maxsize=4)
def _scheduled(text: str) -> dict[str, tuple[Instr, ...]]:
  comps = _computations(text)
  bodies = set(re.findall(r"\bbody=%([\w.\-]+)", text))
  return {k: v for k, v in comps.items() if k == "ENTRY" or k in bodies}


@functools.lru_cache(maxsize=4)
def _computations(text: str) -> dict[str, tuple[Instr, ...]]:
  comps: dict[str, list[Instr]] = {}
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = "ENTRY" if header.group(1) else header.group(2)
      comps[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line) if current else None
    if m:
      args = m.group(3).split(")", 1)[0]
      comps[current].append(Instr(m.group(1), m.group(2),
                                  tuple(re.findall(r"%([\w.\-]+)", args)), line))
  return {k: tuple(v) for k, v in comps.items()}


class Window(NamedTuple):
  kind: str               # e.g. "all-gather", "collective-permute"
  computation: str
  start: int              # index of the start in its computation
  done: int               # index of the done
  between: tuple[Instr, ...]

  @property
  def matmuls(self) -> int:
    return sum(i.is_matmul for i in self.between)


def windows(text: str) -> list[Window]:
  """Every async pair in the scheduled computations whose start and done are
  both there, with what lies between, in the order of their dones.

  The pairs are the library's inspector's (`read_schedule`, which follows a
  start's value, or a TPU fusion chain's state, to its done; itself tested
  on the committed real texts in tests/inspection/inspect_real_forms_test.py); what lies
  between and which of it is a matmul are read here, from the text. A second
  pairing here, walking back from a done through every operand, mis-paired
  TPU chains: from a continuation fusion it followed the fused compute's
  operands to another start (an async copy's)."""
  module = parse_hlo_text(text)
  comps = scheduled(text)
  entry = module.entry.name
  order = {name: k for k, name in enumerate(comps)}
  out = []
  for pair in read_schedule(module).collectives():
    if pair.done is None or pair.done is pair.start or \
        pair.done_computation != pair.computation or \
        any(move == "next" for move, _ in pair.moves):
      continue  # synchronous, or its done in another computation or iteration
    comp = "ENTRY" if pair.computation == entry else pair.computation
    if comp not in comps:
      continue
    index = {i.name: k for k, i in enumerate(comps[comp])}
    start, done = index[pair.start.name], index[pair.done.name]
    out.append(Window(pair.kind, comp, start, done,
                      tuple(comps[comp][start + 1:done])))
  return sorted(out, key=lambda w: (order[w.computation], w.done))


def is_sync(text: str, kind: str) -> bool:
  """Whether some `kind` collective is compiled synchronous (no start/done)."""
  for instrs in scheduled(text).values():
    for i in instrs:
      if i.opcode == kind or ('is_sync=true' in i.line and kind in i.line):
        return True
  return False


#: TPU compiles a matmul to a convolution.
_SAME_OP = {"convolution": "dot"}


def scheduled_markers(text: str, markers) -> list:
  """The `markers` (HLO opcodes) in the order the entry computation runs them.

  As tests/support/lowered.py's, for TPU and GPU texts: a fusion or call counts as
  the markers inside it (a sorted tuple when it holds several), a while loop
  as its body's markers at its place; a TPU convolution is a "dot".
  """
  comps = computations(text)
  markers = set(markers)

  def marker(opcode):
    opcode = _SAME_OP.get(opcode, opcode)
    return opcode if opcode in markers else None

  def called(instr, key):
    return re.findall(rf"\b{key}=%([\w.\-]+)", instr.line)

  def inside(name, seen=()):
    found = set()
    for i in comps.get(name, []):
      if marker(i.opcode):
        found.add(marker(i.opcode))
      for sub in called(i, "calls") + called(i, "to_apply"):
        if sub not in seen:
          found |= inside(sub, (*seen, sub))
    return found

  def walk(name):
    out = []
    for i in comps.get(name, []):
      if i.opcode == "while":
        out += walk(called(i, "body")[0])
        continue
      found = set()
      if marker(i.opcode):
        found.add(marker(i.opcode))
      for sub in called(i, "calls") + called(i, "to_apply"):
        found |= inside(sub)
      if len(found) == 1:
        out.append(found.pop())
      elif found:
        out.append(tuple(sorted(found)))
    return out
  return walk("ENTRY")


class Composed(NamedTuple):
  """A future made of permutes (collectives/permute_forms.py: TPU v5p's
  all-gather and reduce-scatter): its parts' windows, shifts 1, 2, ..."""
  computation: str
  parts: tuple[Window, ...]
  op_name: str
  sources: frozenset   # the parts' operands: one for an all-gather's

  @property
  def is_gather(self) -> bool:
    """An all-gather's parts all send the same shard; a reduce-scatter's
    each send another chunk."""
    return len(self.sources) == 1

  @property
  def matmuls(self) -> int:
    """The matmuls every part has in flight."""
    return min(w.matmuls for w in self.parts)


def _shift(instr: Instr) -> int | None:
  m = re.search(r"source_target_pairs=\{\{0,(\d+)\}", instr.line)
  return int(m.group(1)) if m else None


def permute_futures(text: str) -> list[Composed]:
  """The collective-permute windows grouped into the futures they come
  from: a future's k-th part has shift k (device 0's target) and channel id
  c + k for one c (the library numbers a future's parts in turn), so the
  parts of one future share (computation, channel id - shift). In the order
  of their first start."""
  comps = scheduled(text)
  groups: dict = {}
  for w in windows(text):
    if w.kind != "collective-permute":
      continue
    instr = comps[w.computation][w.start]
    shift = _shift(instr)
    channel = re.search(r"channel_id=(\d+)", instr.line)
    if shift is None or channel is None:
      key = (w.computation, "alone", w.start)
    else:
      key = (w.computation, int(channel.group(1)) - shift)
    groups.setdefault(key, []).append(w)
  out = []
  for key, parts in groups.items():
    # A loop the compiler unrolled repeats its body's channel ids: in start
    # order, each part joins the first future still lacking its shift.
    futures: list[list[Window]] = []
    for w in sorted(parts, key=lambda w: w.start):
      shift = _shift(comps[key[0]][w.start])
      home = next((f for f in futures
                   if shift not in {_shift(comps[key[0]][p.start]) for p in f}),
                  None)
      if home is None:
        futures.append(home := [])
      home.append(w)
    for f in futures:
      op = re.search(r'op_name="([^"]*)"', comps[key[0]][f[0].start].line)
      sources = frozenset(comps[key[0]][p.start].operands[:1] for p in f)
      out.append(Composed(key[0], tuple(f), op.group(1) if op else "", sources))
  return sorted(out, key=lambda f: (f.computation, f.parts[0].start))


def trips(text: str) -> dict[str, int]:
  """While body name -> how many times the loop runs it: the compiler's
  `known_trip_count` where it gives one, else the bound its condition
  compares the counter with (jax's loops count up from 0)."""
  comps = computations(text)
  out = {}
  for m in re.finditer(r"condition=%([\w.\-]+), body=%([\w.\-]+)(.*)", text):
    cond, body, rest = m.groups()
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    if known:
      out[body] = int(known.group(1))
      continue
    bounds = [int(c) for i in comps.get(cond, ())
              for c in re.findall(r"constant\((\d+)\)", i.line)]
    if len(bounds) == 1:
      out[body] = bounds[0]
  return out


def runs(text: str, found: list) -> list:
  """`found` (windows, or futures with a `computation`), each listed once
  per time it runs: a loop body's as many times as its loop iterates (a
  count of a program's windows then does not depend on how far its loops
  are unrolled)."""
  n = trips(text)
  return [w for w in found for _ in range(n.get(w.computation, 1))]
