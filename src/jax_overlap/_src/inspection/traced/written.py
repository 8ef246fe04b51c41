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

from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)
from jax_overlap._src.inspection.traced import jaxpr as traced
from jax_overlap._src.inspection.traced.jaxpr import HLO_KIND
from jax_overlap._src.patterns.leaf_scope import leaf_from_op_name

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
  overlapped: list[str] = dataclasses.field(default_factory=list)
  costs: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  loop: str | None = None
  finished: bool = False


def written_windows(jaxpr) -> list[WrittenWindow]:
  """Every future started in `jaxpr` (e.g. `jax.jit(f).trace(*a).jaxpr`)."""
  walker = _Walker()
  walker.walk(jaxpr, {}, None)
  return walker.windows


class _Walker:

  def __init__(self):
    self.windows: list[WrittenWindow] = []
    self.open: dict[int, list[WrittenWindow]] = {}

  def walk(self, jaxpr, axis_sizes: dict[str, int], loop: str | None,
           scopes: str = "") -> None:
    for eqn in traced.eqns(jaxpr):
      prim = eqn.primitive
      # scopes of a nested jaxpr's equations are relative to its holder's
      eqn_scopes = "/".join(s for s in (scopes, traced.name_stack(eqn)) if s)
      if prim is collective_start_p:
        self._start(eqn, axis_sizes, loop, eqn_scopes)
        continue
      if prim is collective_done_p:
        opened = self.open.get(id(eqn.params["comm"].state))
        if opened:
          opened.pop(0).finished = True
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
          self.walk(sub, inner_sizes, inner_loop, eqn_scopes)

  def _start(self, eqn, axis_sizes, loop, scopes: str) -> None:
    comm = eqn.params["comm"]
    out = comm.out_aval
    window = WrittenWindow(
        collective=comm.name, kind=HLO_KIND.get(comm.name, comm.name),
        where=comm.state.where, bytes=traced.aval_bytes(out),
        group_size=traced.comm_group_size(comm, axis_sizes),
        leaf=leaf_from_op_name(scopes), loop=loop)
    self.windows.append(window)
    self.open.setdefault(id(comm.state), []).append(window)

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
