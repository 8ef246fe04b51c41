"""Reading lowered programs in tests: barrier counts and op order."""

from __future__ import annotations

import re

import jax
from jax._src import core as jax_core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.primitives import (collective_done_p,
                                                     collective_start_p)

HAS_LOJAX = _compat.USE_HIJAX


def stablehlo(fn, *args, **kwargs) -> str:
  return jax.jit(fn).lower(*args, **kwargs).as_text()


def barriers_in_stablehlo(fn, *args, **kwargs) -> int:
  """Counts `stablehlo.optimization_barrier` ops in the lowered program."""
  return len(re.findall(r"stablehlo\.optimization_barrier",
                        stablehlo(fn, *args, **kwargs)))


def traced_jaxpr(fn, *args, **kwargs):
  return jax.jit(fn).trace(*args, **kwargs).jaxpr


def lojax_jaxpr(fn, *args, **kwargs):
  """The lojax jaxpr where jax has one (>= 0.12); else None."""
  traced = jax.jit(fn).trace(*args, **kwargs)
  return traced.lojax.jaxpr if HAS_LOJAX else None


def count_in_jaxpr(jaxpr, name: str) -> int:
  return str(jaxpr).count(name)


def stablehlo_ops(text: str, names) -> list[str]:
  """The ops among `names` in the order they appear in StableHLO text."""
  pattern = "|".join(re.escape(n) for n in names)
  return re.findall(rf"(?:stablehlo\.|\b)({pattern})\b", text)


# --- the compiled schedule ----------------------------------------------------------
# A deliberately small reader of `compiled.as_text()` (an `is_scheduled=true`
# module lists each computation's instructions in schedule order), kept apart
# from the library's own HLO reader so that tests do not check it with itself.

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [(].*[{]\s*$")
_INSTRUCTION = re.compile(
    r"^\s+(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\((.*)$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations)="
                     r"\{?%?([\w.\-]+)")

def _computations(text: str) -> dict[str, list[tuple[str, str, list[tuple[str, str]]]]]:
  """name -> [(instruction, opcode, [(call kind, computation)])] in order."""
  comps: dict[str, list] = {}
  current = None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = comps.setdefault(m.group(1), [])
      if line.startswith("ENTRY"):
        comps["ENTRY"] = current
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      current.append((m.group(1), m.group(2), _CALLED.findall(line)))
  return comps


def scheduled_markers(compiled_text: str, markers) -> list:
  """The `markers` (HLO opcodes) in the order the compiled program runs them.

  Walks the entry computation in schedule order; a fusion or call counts as
  the markers inside it (a sorted tuple when it holds several: they were
  fused together), and a while loop as its body's markers at its place.
  """
  comps = _computations(compiled_text)
  markers = set(markers)

  def inside(name):
    found = set()
    for _, opcode, called in comps.get(name, []):
      if opcode in markers:
        found.add(opcode)
      for _, sub in called:
        found |= inside(sub)
    return found

  def walk(name):
    out = []
    for _, opcode, called in comps.get(name, []):
      if opcode == "while":
        body = [c for kind, c in called if kind == "body"]
        out += walk(body[0])
        continue
      found = {opcode} & markers
      for kind, sub in called:
        if kind in ("calls", "to_apply"):
          found |= inside(sub)
      if len(found) == 1:
        out.append(found.pop())
      elif found:
        out.append(tuple(sorted(found)))
    return out
  return walk("ENTRY")


# jax primitive -> the HLO opcode it becomes, for the ops schedule tests follow.
MARKER_OF_PRIMITIVE = {"dot_general": "dot", "tanh": "tanh", "sin": "sine",
                       "exp": "exponential", "cos": "cosine", "log": "log",
                       "rev": "reverse", "pad": "pad", "slice": "slice"}


def written_markers(jaxpr) -> list:
  """The marker ops of a traced program in the order it writes them.

  Nested jaxprs (jit calls, ordered blocks, loop bodies) are read in place; a
  free block (`program_order(enforce=False)`) counts as the set of markers
  inside it, since XLA may order those as it likes.
  """
  out = []
  if type(jaxpr).__name__ == "ClosedJaxpr":
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    subs = list(jax_core.jaxprs_in_params(eqn.params))
    if eqn.primitive.name == "program_order" and not eqn.params["enforce"]:
      inner = [m for sub in subs for m in _flat(written_markers(sub))]
      out.append(frozenset(inner))
    elif subs:
      for sub in subs:
        out += written_markers(sub)
    elif eqn.primitive.name in MARKER_OF_PRIMITIVE:
      out.append(MARKER_OF_PRIMITIVE[eqn.primitive.name])
  return out


def _flat(steps):
  for s in steps:
    yield from (s if isinstance(s, frozenset) else (s,))


def follows(scheduled: list, written: list) -> bool:
  """Whether the compiled order keeps the written one.

  Markers XLA removed (a pad folded into a slice) are left out of the
  written order; a fused pair of markers (a tuple in `scheduled`) never
  keeps it; a free block's markers may come in any order, together.
  """
  if any(isinstance(m, tuple) for m in scheduled):
    return False
  present = set(scheduled)
  steps = [s & present if isinstance(s, frozenset) else s for s in written
           if (s & present if isinstance(s, frozenset) else s in present)]
  i = 0
  for step in steps:
    n = len(step) if isinstance(step, frozenset) else 1
    got = scheduled[i:i + n]
    want = sorted(step) if isinstance(step, frozenset) else [step]
    if sorted(got) != want:
      return False
    i += n
  return i == len(scheduled)


def flat_eqns(jaxpr):
  """Every equation, nested jaxprs inlined where their equation stands."""
  for eqn in jaxpr.eqns:
    subs = list(jax_core.jaxprs_in_params(eqn.params))
    if not subs:
      yield eqn
    for sub in subs:
      yield from flat_eqns(sub)


def future_windows(fn, *args):
  """For each collective future's start in `jax.jit(fn)`'s traced program,
  in order: the primitive names between it and its done."""
  eqns = list(flat_eqns(jax.jit(fn).trace(*args).jaxpr))
  windows = []
  for i, eqn in enumerate(eqns):
    if eqn.primitive is not collective_start_p:
      continue
    in_flight = eqn.outvars[0]
    for j in range(i + 1, len(eqns)):
      if (eqns[j].primitive is collective_done_p
          and eqns[j].invars[0] is in_flight):
        windows.append([e.primitive.name for e in eqns[i + 1:j]])
        break
    else:
      raise AssertionError(f"no done for the start at equation {i}")
  return windows
