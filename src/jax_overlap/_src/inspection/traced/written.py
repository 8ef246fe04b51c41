"""Written windows: the compute a program writes between each future's start
and its `done()`, read from the traced program (not from what was compiled).

Where the backend makes collectives blocking (CPU does) the compiled module
has no window left to show; this is what the user asked for instead. The
traced jaxpr is walked in program order, into every nested jaxpr (jit calls,
`shard_map`, `program_order` blocks, scan and while bodies, cond branches,
custom derivatives). Compute is `dot_general`, `conv_general_dilated` and
custom kernels (`ffi_call`, `pallas_call`, custom calls): the operations that
can hide a collective. Elementwise work is not counted.
"""

from __future__ import annotations

import dataclasses

from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)
from jax_overlap._src.inspection.traced import jaxpr as traced
from jax_overlap._src.inspection.traced.jaxpr import HLO_KIND
from jax_overlap._src.inspection.reading.attributes import leaf_in, step_in

#: Primitives counted as compute in a written window.
COMPUTE_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"}
                               | traced.KERNEL_PRIMITIVES)
_LOOPS = {"scan": "length", "while": None}


@dataclasses.dataclass
class WrittenWindow:
  """One future as written: which collective, where it started, and the
  compute written between its start and its done (`overlapped`, each as
  'primitive dtype[shape]', with `(flops, bytes)` of each in `costs`);
  `loop` names the loop whose body holds it ('scan x4')."""

  collective: str
  kind: str
  where: str
  bytes: float
  group_size: int | None
  leaf: str | None = None
  step: str | None = None
  overlapped: list[str] = dataclasses.field(default_factory=list)
  costs: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  loop: str | None = None
  finished: bool = False


def written_windows(jaxpr) -> list[WrittenWindow]:
  """Every future started in `jaxpr` (e.g. `jax.jit(f).trace(*a).jaxpr`).

  A done finishes the window of the start whose value it takes, followed
  through nested jaxprs and loop carries (pairs follow data, as in
  `schedule/pairing.py`); only where that value cannot be followed is it
  matched by the future's state. The done autodiff writes for a
  transposed future carries the forward future's `comm`, not the
  transposed one's, so a match by state alone left the gradient's
  reduce-scatter "done() not found" (tests/integration/real_clients_report_test.py)."""
  walker = _Walker()
  walker.walk(jaxpr, {}, None, env={})
  return walker.windows


class _Walker:

  def __init__(self):
    self.windows: list[WrittenWindow] = []
    self.open: dict[int, list[WrittenWindow]] = {}
    self.key: dict[int, int] = {}   # id(window) -> its key in `open`

  def walk(self, jaxpr, axis_sizes: dict[str, int], loop: str | None,
           scopes: str = "", env: dict | None = None) -> tuple[list, set]:
    """Walks `jaxpr` with `env` mapping its in-flight values to their
    windows; returns (the window each output holds or None, the ids of
    the input variables a done took)."""
    env = {} if env is None else env
    consumed: set[int] = set()
    for eqn in traced.eqns(jaxpr):
      prim = eqn.primitive
      # scopes of a nested jaxpr's equations are relative to its holder's
      eqn_scopes = "/".join(s for s in (scopes, traced.name_stack(eqn)) if s)
      if prim is collective_start_p:
        env[eqn.outvars[0]] = self._start(eqn, axis_sizes, loop, eqn_scopes)
        continue
      if prim is collective_done_p:
        self._done(eqn, env, consumed)
        continue
      if prim.name in COMPUTE_PRIMITIVES:
        self._compute(eqn)
      inner_sizes = traced.inner_axis_sizes(eqn, axis_sizes)
      inner_loop = loop
      if prim.name in _LOOPS:
        length = eqn.params.get(_LOOPS[prim.name]) if _LOOPS[prim.name] else None
        inner_loop = prim.name + (f" x{length}" if length else "")
      for key, value in eqn.params.items():
        if key == "comm":
          continue
        for sub in traced.sub_jaxprs(value):
          self._nested(eqn, key, sub, env, consumed, inner_sizes, inner_loop,
                       eqn_scopes)
    _, outvars = traced.open_vars(jaxpr)
    return [env.get(v) if _is_var(v) else None for v in outvars], consumed

  def _nested(self, eqn, key, sub, env, consumed, sizes, loop,
              scopes) -> None:
    """Walks `sub` (held by `eqn` under `key`) with the windows of `eqn`'s
    inputs, and gives `eqn`'s outputs the windows `sub`'s outputs hold. A
    loop body's carry that a done took finishes, in the next iteration,
    what the body hands on in the same slot."""
    invars, outvars = traced.open_vars(sub)
    outer = list(eqn.invars)
    if eqn.primitive.name == "while":
      if key == "cond_jaxpr":
        outer = outer[:eqn.params["cond_nconsts"]] + outer[
            eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]:]
      else:
        outer = outer[eqn.params["cond_nconsts"]:]
    elif eqn.primitive.name == "cond":
      outer = outer[1:]
    n = min(len(invars), len(outer))  # consts, if any, come first
    inner = {}
    for i, o in zip(invars[len(invars) - n:], outer[len(outer) - n:]):
      if _is_var(o) and o in env:
        inner[i] = env[o]
    held, took = self.walk(sub, sizes, loop, scopes, env=inner)
    taken = {k for k, i in enumerate(invars) if id(i) in took}
    for k, i in enumerate(invars[len(invars) - n:]):
      o = outer[len(outer) - n + k]
      if id(i) in took and _is_var(o):
        consumed.add(id(o))
    carry = _carry_slots(eqn, key, len(invars))
    for slot_in, slot_out in carry:
      window = held[slot_out] if slot_out < len(held) else None
      if slot_in in taken and window is not None:
        self._finish(window)
    for o, window in zip(eqn.outvars, held):
      if window is not None and not window.finished:
        env[o] = window

  def _done(self, eqn, env, consumed) -> None:
    flight = eqn.invars[0]
    window = env.get(flight) if _is_var(flight) else None
    if _is_var(flight):
      consumed.add(id(flight))
    if window is None:  # not followed: the future's own state says
      opened = self.open.get(id(eqn.params["comm"].state))
      window = opened[0] if opened else None
    if window is not None:
      self._finish(window)

  def _finish(self, window: WrittenWindow) -> None:
    if window.finished:
      return
    window.finished = True
    opened = self.open.get(self.key.get(id(window)), [])
    if window in opened:
      opened.remove(window)

  def _start(self, eqn, axis_sizes, loop, scopes: str) -> None:
    comm = eqn.params["comm"]
    out = comm.out_aval
    window = WrittenWindow(
        collective=comm.name, kind=HLO_KIND.get(comm.name, comm.name),
        where=comm.state.where, bytes=traced.aval_bytes(out),
        group_size=traced.comm_group_size(comm, axis_sizes),
        leaf=leaf_in(scopes), step=step_in(scopes), loop=loop)
    self.windows.append(window)
    self.open.setdefault(id(comm.state), []).append(window)
    self.key[id(window)] = id(comm.state)
    return window

  def _compute(self, eqn) -> None:
    windows = [w for opened in self.open.values() for w in opened]
    if not windows:
      return
    out = eqn.outvars[0].aval if eqn.outvars else None
    label = eqn.primitive.name + (f" {traced.aval_text(out)}"
                                  if out is not None else "")
    flops = traced.flops(eqn)
    nbytes = sum(traced.aval_bytes(v.aval) for v in list(eqn.invars) + eqn.outvars
                 if hasattr(v, "aval"))
    for window in windows:
      window.overlapped.append(label)
      window.costs.append((flops, nbytes))


def _is_var(v) -> bool:
  return isinstance(v, core.Var)


def _carry_slots(eqn, key: str, n_in: int) -> list[tuple[int, int]]:
  """(body input, body output) index pairs of a loop body's carries."""
  p = eqn.params
  if eqn.primitive.name == "scan" and key == "jaxpr":
    consts, carried = _compat.scan_counts(p)
    return [(consts + k, k) for k in range(carried)]
  if eqn.primitive.name == "while" and key == "body_jaxpr":
    consts = p["body_nconsts"]
    return [(consts + k, k) for k in range(n_in - consts)]
  return []
