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
import math
from typing import Any

from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)

#: Primitives counted as compute in a written window.
COMPUTE_PRIMITIVES = frozenset({
    "dot_general", "conv_general_dilated", "ffi_call", "pallas_call",
    "custom_call", "tpu_custom_call", "mosaic_gpu_call", "triton_kernel_call"})

#: Our collectives by the name of the HLO collective they lower to.
HLO_KIND = {"all_gather": "all-gather", "psum": "all-reduce",
            "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all",
            "ppermute": "collective-permute"}
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

  def walk(self, jaxpr, axis_sizes: dict[str, int], loop: str | None) -> None:
    for eqn in _eqns(jaxpr):
      prim = eqn.primitive
      if prim is collective_start_p:
        self._start(eqn, axis_sizes, loop)
        continue
      if prim is collective_done_p:
        opened = self.open.get(id(eqn.params["comm"].state))
        if opened:
          opened.pop(0).finished = True
        continue
      if prim.name in COMPUTE_PRIMITIVES:
        self._compute(eqn)
      inner_sizes = axis_sizes
      mesh = eqn.params.get("mesh")
      if mesh is not None and hasattr(mesh, "shape"):
        inner_sizes = {**axis_sizes, **dict(mesh.shape)}
      inner_loop = loop
      if prim.name in _LOOPS:
        length = eqn.params.get(_LOOPS[prim.name]) if _LOOPS[prim.name] else None
        inner_loop = prim.name + (f" x{length}" if length else "")
      for key, value in eqn.params.items():
        if key == "comm":
          continue
        for sub in _sub_jaxprs(value):
          self.walk(sub, inner_sizes, inner_loop)

  def _start(self, eqn, axis_sizes, loop) -> None:
    comm = eqn.params["comm"]
    out = comm.out_aval
    window = WrittenWindow(
        collective=comm.name, kind=HLO_KIND.get(comm.name, comm.name),
        where=comm.state.where, bytes=_aval_bytes(out),
        group_size=_group_size(comm, axis_sizes), loop=loop)
    self.windows.append(window)
    self.open.setdefault(id(comm.state), []).append(window)

  def _compute(self, eqn) -> None:
    windows = [w for opened in self.open.values() for w in opened]
    if not windows:
      return
    out = eqn.outvars[0].aval if eqn.outvars else None
    label = eqn.primitive.name + (f" {_aval_text(out)}" if out is not None
                                  else "")
    flops = _flops(eqn)
    nbytes = sum(_aval_bytes(v.aval) for v in list(eqn.invars) + eqn.outvars
                 if hasattr(v, "aval"))
    for window in windows:
      window.overlapped.append(label)
      window.costs.append((flops, nbytes))


def _eqns(jaxpr):
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  return getattr(inner, "eqns", getattr(jaxpr, "eqns", []))


def _sub_jaxprs(value) -> list[Any]:
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
    return [value]
  return []


def _group_size(comm, axis_sizes: dict[str, int]) -> int | None:
  for eqn in _eqns(comm.jaxpr):
    if "axis_size" in eqn.params and isinstance(eqn.params["axis_size"], int):
      return eqn.params["axis_size"]
    names = eqn.params.get("axis_name", eqn.params.get("axes"))
    if names is None:
      continue
    names = names if isinstance(names, (tuple, list)) else (names,)
    sizes = [axis_sizes.get(n) for n in names if not isinstance(n, int)]
    if sizes and all(s is not None for s in sizes):
      return math.prod(sizes)
  return None


def _aval_bytes(aval) -> float:
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0.0
  return float(math.prod(shape) * dtype.itemsize)


def _aval_text(aval) -> str:
  dtype = getattr(aval, "dtype", None)
  short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
           "float64": "f64", "int32": "s32", "int8": "s8"}.get(
               str(dtype), str(dtype))
  return f"{short}[{','.join(str(d) for d in getattr(aval, 'shape', ()))}]"


def _flops(eqn) -> float:
  name = eqn.primitive.name
  out = eqn.outvars[0].aval
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d]
                                                  for d in lhs_contract)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    numbers = eqn.params.get("dimension_numbers")
    out_feature = numbers.rhs_spec[0] if numbers is not None else 0
    per_output = math.prod(rhs.shape) / max(rhs.shape[out_feature], 1)
    return 2.0 * math.prod(out.shape) * per_output
  return 0.0
