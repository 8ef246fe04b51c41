"""The written schedule: the traced program in the order it is written, as a
scheduled module that `schedule.py` and `simulate.py` read as they read a
compiled one.

This is what `program_order` asks the compiler to keep, so it answers "how
much communication would this step expose if the written order were kept?"
where the compiled program cannot (CPU makes every collective blocking).

The traced jaxpr is walked in program order. Calls are inlined: nested jit,
`shard_map` (whose mesh gives the axis sizes), `program_order` blocks,
custom derivatives and `checkpoint`. A `cond` becomes its costliest branch
(and a note says so). A `scan` becomes a `while` whose `known_trip_count` is
its length, a `while_loop` a `while` of unknown trip count, each with its
body once: the simulation repeats it. Each future becomes an async pair
(`all-gather-start` ... `all-gather-done`) whose done takes the start's
value, carried through loops as a compiled module carries it; a jax.lax
collective becomes a synchronous one. Every other operation is a compute
instruction of its own, costed from its shapes (`CostSource` below):

* `dot_general`, `conv_general_dilated`: flops as in `traced.flops`;
* bytes: every operand in and every result out, except that a slice or
  gather reads only what it returns, and an update in place (dynamic
  update slice, scatter) writes only the update;
* nothing is fused; reshapes and type bookkeeping (`pvary`, shardings) are
  free, as a bitcast is, and so is arithmetic on scalars alone (indices).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.primitives import (
    collective_done_p, collective_start_p)
from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.traced import jaxpr as traced
from jax_overlap._src.inspection.model.cost_model import CostModel
from jax_overlap._src.inspection.model.hardware import HardwareProfile
from jax_overlap._src.inspection.reading.hlo_module import (
    HloComputation, HloInstruction, HloModule)
from jax_overlap._src.inspection.reading.shapes import Shape

COST_LABEL = "shapes in the traced program"
ENTRY = "main"

def _by_primitive(kinds: dict[str, str]) -> dict[str, str]:
  """{HLO collective: "primitive primitive ..."} as {primitive: collective}."""
  return {p: kind for kind, names in kinds.items() for p in names.split()}


#: jax.lax collectives, run synchronously, by the HLO collective they are.
SYNC_COLLECTIVES = _by_primitive({
    "all-reduce": "psum psum_invariant pmax pmin unreduced_psum "
                  "unreduced_pmax unreduced_pmin",
    "all-gather": "all_gather all_gather_invariant all_gather_reduced",
    "reduce-scatter": "reduce_scatter unreduced_reduce_scatter",
    "all-to-all": "all_to_all",
    "ragged-all-to-all": "ragged_all_to_all",
    "collective-permute": "ppermute",
    "collective-broadcast": "pbroadcast pbroadcast_dynamic",
})
#: jax's own async collectives: a start whose result a done takes.
JAX_ASYNC_STARTS = _by_primitive({
    "all-gather": "all_gather_start all_gather_reduced_start",
    "all-reduce": "psum_start psum_invariant_start unreduced_psum_start",
    "reduce-scatter": "reduce_scatter_start unreduced_reduce_scatter_start",
    "all-to-all": "all_to_all_start",
    "collective-permute": "ppermute_start",
    "collective-broadcast": "pbroadcast_start",
})
JAX_ASYNC_DONES = {
    "all_gather_done": "all-gather", "psum_done": "all-reduce",
    "reduce_scatter_done": "reduce-scatter", "all_to_all_done": "all-to-all",
    "ppermute_done": "collective-permute",
    "pbroadcast_done": "collective-broadcast"}
#: No time: a bitcast in XLA, or bookkeeping of types and shardings.
FREE_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "pvary", "pcast", "preduced",
    "vary_unreduced_cast", "axis_index", "optimization_barrier",
    "sharding_constraint", "reshard", "mesh_cast", "device_put"})
_READS_ITS_RESULT = frozenset({"slice", "dynamic_slice", "gather"})
#: Updates in place, and which operand is the update.
_UPDATE_OPERAND = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2,
                   "scatter_add": 2, "scatter_mul": 2, "scatter_min": 2,
                   "scatter_max": 2}


@dataclasses.dataclass
class WrittenSchedule:
  """The module, the (flops, bytes) of each compute instruction by name,
  and notes on what was chosen (a cond's branch)."""

  module: HloModule
  costs: dict[str, tuple[float, float]]
  notes: list[str]

  def cost(self, instr: HloInstruction,
           comp: HloComputation) -> tuple[float, float] | None:
    """A `CostSource`: the costs read from the traced program."""
    del comp
    return self.costs.get(instr.name)


def written_schedule(jaxpr, hardware: HardwareProfile,
                     name: str = "written") -> WrittenSchedule:
  """The written order of `jaxpr` (`jax.jit(f).trace(*a).jaxpr`) as a
  scheduled module; `hardware` ranks the branches of a `cond`."""
  builder = _Builder(CostModel(hardware, None))
  entry: list[HloInstruction] = [builder.parameter()]
  builder.emit(jaxpr, {}, {}, entry)
  builder.add(ENTRY, entry, is_entry=True)
  module = HloModule(name, {"is_scheduled": "true"}, builder.computations,
                     source=f"traced program of {name}")
  return WrittenSchedule(module, builder.costs, builder.notes())


def _is_var(v) -> bool:
  return isinstance(v, core.Var)


def _shape(aval) -> Shape:
  dtype = traced.hlo_dtype(aval)
  dims = tuple(int(d) for d in getattr(getattr(aval, "inner_aval", aval),
                                       "shape", ()))
  if dtype is None:  # no HLO name: as bytes, so the size is kept
    return Shape("u8", (int(traced.aval_bytes(aval)),))
  return Shape(dtype, dims)


def _tuple(avals) -> Shape:
  return Shape(elements=tuple(_shape(a) for a in avals))


def _where(text: str) -> tuple[str, int] | None:
  """(file, line) of a future's `where`, 'file:line[:column] (function)'."""
  m = re.match(r"(.*?):(\d+)(?::\d+)?(?: \(.*\))?$", text or "")
  return (m.group(1), int(m.group(2))) if m else None


def _metadata(op_name: str, eqn, where: tuple[str, int] | None = None,
              scopes: str = "") -> str:
  where = where or traced.source_line(eqn)
  op_name = f"{scopes}/{op_name}" if scopes else op_name  # as jax writes it
  text = f"op_name={json.dumps(op_name, ensure_ascii=False)}"
  if where is not None:
    text += (f" source_file={json.dumps(where[0], ensure_ascii=False)}"
             f" source_line={where[1]}")
  return "{" + text + "}"


class _Builder:

  def __init__(self, model: CostModel):
    self.model = model
    self.counts: collections.Counter[str] = collections.Counter()
    self.computations: dict[str, HloComputation] = {}
    self.costs: dict[str, tuple[float, float]] = {}
    self.comm: dict[str, tuple[str, float, int | None]] = {}
    # The (kind, label) of the start whose value each instruction holds
    # (the start itself, or a tuple element carrying it through a loop).
    self.flight: dict[str, tuple[str, str]] = {}
    # (source line, branches) -> how often each branch was the costliest:
    # one note a cond in the source (a pipeline's switch is one a tick)
    self.conds: dict[tuple[str, int], collections.Counter[int]] = {}
    self.scopes: list[str] = []

  # --- instructions -------------------------------------------------------------

  def fresh(self, base: str) -> str:
    self.counts[base] += 1
    return f"{base}.{self.counts[base]}"

  def parameter(self) -> HloInstruction:
    return HloInstruction(self.fresh("param"), "parameter", Shape(elements=()),
                          (), {}, operand_text="0")

  def add(self, name: str, instructions: list[HloInstruction],
          is_entry: bool = False) -> None:
    self.computations[name] = HloComputation(name, instructions,
                                             is_entry=is_entry)

  def _group(self, kind: str, size: int | None, perm) -> dict[str, str]:
    if kind == "collective-permute" and perm:
      return {"source_target_pairs":
              "{" + ",".join(f"{{{a},{b}}}" for a, b in perm) + "}"}
    if size is None:
      return {}
    return {"replica_groups": f"[1,{size}]<=[{size}]"}

  # --- the walk -------------------------------------------------------------------

  def emit(self, jaxpr, env: dict, sizes: dict[str, int],
           out: list[HloInstruction]) -> None:
    """Appends the instructions of `jaxpr` to `out`. `env` maps each value
    to the instruction that holds it (a future's, and every other value, so
    that operands carry the program's data dependencies)."""
    for eqn in traced.eqns(jaxpr):
      # A nested jaxpr's equations carry their scopes relative to the
      # equation that holds it; jax joins them when it lowers, and so do we.
      self.scopes.append(traced.name_stack(eqn))
      try:
        self.equation(eqn, env, sizes, out)
      finally:
        self.scopes.pop()

  def metadata(self, op_name: str, eqn, where=None) -> str:
    return _metadata(op_name, eqn, where,
                     "/".join(s for s in self.scopes if s))

  def equation(self, eqn, env, sizes, out) -> None:
    name = eqn.primitive.name
    if eqn.primitive is collective_start_p:
      comm = eqn.params["comm"]
      perm = next((e.params["perm"] for e in traced.eqns(comm.jaxpr)
                   if "perm" in e.params), None)
      self.start(eqn, traced.HLO_KIND.get(comm.name, comm.name), comm.name,
                 comm.out_aval, traced.comm_group_size(comm, sizes), perm,
                 env, out, where=_where(comm.state.where))
    elif name in JAX_ASYNC_STARTS:
      self.start(eqn, JAX_ASYNC_STARTS[name], name[:-len("_start")],
                 eqn.outvars[0].aval, traced.group_size(eqn, sizes),
                 eqn.params.get("perm"), env, out)
    elif eqn.primitive is collective_done_p:
      comm = eqn.params["comm"]
      self.done(eqn, env, out, traced.HLO_KIND.get(comm.name, comm.name),
                comm.name)
    elif name in JAX_ASYNC_DONES:
      self.done(eqn, env, out, JAX_ASYNC_DONES[name], name[:-len("_done")])
    elif name in SYNC_COLLECTIVES:
      self.synchronous(eqn, SYNC_COLLECTIVES[name], sizes, env, out)
    elif name in ("scan", "while"):
      self.loop(eqn, env, sizes, out)
    elif name == "cond":
      self.cond(eqn, env, sizes, out)
    elif name in traced.KERNEL_PRIMITIVES:
      self.compute(eqn, "custom-call", env, out)
    elif name in FREE_PRIMITIVES or _scalar(eqn):
      self.alias(eqn, env, out)
    else:
      subs = [s for value in eqn.params.values()
              for s in traced.sub_jaxprs(value)]
      if subs:
        self.inline(eqn, subs[0], env, sizes, out)
      else:
        self.compute(eqn, {"dot_general": "dot",
                           "conv_general_dilated": "convolution"}.get(
                               name, "fusion"), env, out)

  def start(self, eqn, kind, label, out_aval, size, perm, env, out,
            where=None) -> None:
    shape = Shape(elements=(_shape(eqn.invars[0].aval), _shape(out_aval)))
    attributes = self._group(kind, size, perm)
    attributes["metadata"] = self.metadata(label + "_start", eqn, where)
    instr = HloInstruction(self.fresh(label + "_start"), kind + "-start",
                           shape, self.operands(eqn, env), attributes)
    out.append(instr)
    self.comm[instr.name] = (kind, traced.aval_bytes(out_aval), size)
    self.flight[instr.name] = (kind, label)
    env[eqn.outvars[0]] = instr.name

  def done(self, eqn, env, out, kind: str, label: str) -> None:
    """A done named for the start whose value it takes, where that start is
    followed here (a done and its start carry one `Comm`, also for the
    gradient's transposed collective: tests/collectives/transposed_names_test.py;
    the report's side: tests/integration/real_clients_report_test.py)."""
    flight = eqn.invars[0]
    value = env.get(flight) if _is_var(flight) else None
    kind, label = self.flight.get(value, (kind, label))
    instr = HloInstruction(self.fresh(label + "_done"), kind + "-done",
                           _shape(eqn.outvars[0].aval),
                           (value,) if value else (), {})
    out.append(instr)
    self.produced(eqn, env, instr.name)

  def operands(self, eqn, env) -> tuple[str, ...]:
    """The instructions holding `eqn`'s inputs, each once."""
    names = []
    for v in eqn.invars:
      if _is_var(v) and v in env and env[v] not in names:
        names.append(env[v])
    return tuple(names)

  def produced(self, eqn, env, name: str) -> None:
    for v in eqn.outvars:
      env[v] = name

  def alias(self, eqn, env, out) -> None:
    """A free operation: its outputs are held where its inputs are (one
    input), or by a free tuple joining them."""
    names = self.operands(eqn, env)
    if not names:
      return
    if len(names) == 1:
      self.produced(eqn, env, names[0])
      return
    join = HloInstruction(self.fresh("join"), "tuple", Shape(elements=()),
                          names, {})
    out.append(join)
    self.produced(eqn, env, join.name)

  def synchronous(self, eqn, kind, sizes, env, out) -> None:
    size = traced.group_size(eqn, sizes)
    attributes = self._group(kind, size, eqn.params.get("perm"))
    attributes["metadata"] = self.metadata(eqn.primitive.name, eqn)
    avals = [v.aval for v in eqn.outvars]
    shape = _shape(avals[0]) if len(avals) == 1 else _tuple(avals)
    instr = HloInstruction(self.fresh(eqn.primitive.name), kind, shape,
                           self.operands(eqn, env), attributes)
    out.append(instr)
    self.produced(eqn, env, instr.name)
    self.comm[instr.name] = (kind, sum(traced.aval_bytes(a) for a in avals),
                             size)

  def compute(self, eqn, opcode, env, out) -> None:
    avals = [v.aval for v in eqn.outvars]
    shape = _shape(avals[0]) if len(avals) == 1 else _tuple(avals)
    instr = HloInstruction(self.fresh(eqn.primitive.name), opcode, shape,
                           self.operands(eqn, env),
                           {"metadata": self.metadata(eqn.primitive.name, eqn)})
    out.append(instr)
    self.produced(eqn, env, instr.name)
    self.costs[instr.name] = _costs(eqn)

  def inline(self, eqn, sub, env, sizes, out) -> None:
    invars, outvars = traced.open_vars(sub)
    n = min(len(invars), len(eqn.invars))  # consts, if any, come first
    inner = {i: env[o] for i, o in zip(invars[len(invars) - n:],
                                       eqn.invars[len(eqn.invars) - n:])
             if _is_var(o) and o in env}
    self.emit(sub, inner, traced.inner_axis_sizes(eqn, sizes), out)
    for o, i in zip(eqn.outvars, outvars):
      if _is_var(i) and i in inner:
        env[o] = inner[i]

  # --- loops and conditionals --------------------------------------------------

  def loop(self, eqn, env, sizes, out) -> None:
    """A `while` running the body once per iteration; futures in flight
    across its boundary travel in its tuple, as in a compiled module."""
    p = eqn.params
    if eqn.primitive.name == "scan":
      body, cond = p["jaxpr"], None
      outer = list(eqn.invars)
      (fixed, carried), trip = _compat.scan_counts(p), p["length"]
    else:
      body, cond = p["body_jaxpr"], p["cond_jaxpr"]
      outer = list(eqn.invars[p["cond_nconsts"]:])
      fixed, trip = p["body_nconsts"], None
      carried = len(outer) - fixed
    body_in, body_out = traced.open_vars(body)
    # Every input held here travels in the tuple, a scan's xs too (sliced in
    # the body, passed through unchanged), so the body's operands see them.
    tracked = [k for k, v in enumerate(outer) if _is_var(v) and v in env]
    init = HloInstruction(self.fresh("tuple"), "tuple", Shape(elements=()),
                          tuple(env[outer[k]] for k in tracked), {})
    out.append(init)
    loop_name = self.fresh(eqn.primitive.name)
    param = self.parameter()
    instrs, body_env, passed = [param], {}, []
    for index, k in enumerate(tracked):
      gte = HloInstruction(self.fresh("get-tuple-element"),
                           "get-tuple-element", Shape(elements=()),
                           (param.name,), {"index": str(index)})
      instrs.append(gte)
      body_env[body_in[k]] = gte.name
      passed.append(gte.name)
      if env[outer[k]] in self.flight:
        self.flight[gte.name] = self.flight[env[outer[k]]]
    self.emit(body, body_env, sizes, instrs)
    root = []
    for index, k in enumerate(tracked):
      value = body_out[k - fixed] if fixed <= k < fixed + carried else None
      root.append(body_env.get(value, passed[index]) if _is_var(value)
                  else passed[index])
    instrs.append(HloInstruction(self.fresh("tuple"), "tuple",
                                 Shape(elements=()), tuple(root), {},
                                 is_root=True))
    self.add(loop_name + "_body", instrs)
    cond_instrs = [self.parameter()]
    if cond is not None:  # a condition takes no future: nothing to map
      self.emit(cond, {}, sizes, cond_instrs)
    self.add(loop_name + "_condition", cond_instrs)
    attributes = {"body": f"%{loop_name}_body",
                  "condition": f"%{loop_name}_condition",
                  "metadata": self.metadata(eqn.primitive.name, eqn)}
    if trip is not None:
      attributes["backend_config"] = json.dumps(
          {"known_trip_count": {"n": str(trip)}})
    out.append(HloInstruction(loop_name, "while", Shape(elements=()),
                              (init.name,), attributes))
    # What the loop makes (a scan's stacked outputs, carries it does not
    # pass through) is held by the loop itself.
    self.produced(eqn, env, loop_name)
    for index, k in enumerate(tracked):
      if fixed <= k < fixed + carried and _is_var(body_out[k - fixed]) and \
          body_out[k - fixed] in body_env:
        gte = HloInstruction(self.fresh("get-tuple-element"),
                             "get-tuple-element", Shape(elements=()),
                             (loop_name,), {"index": str(index)})
        out.append(gte)
        env[eqn.outvars[k - fixed]] = gte.name
        if root[index] in self.flight:
          self.flight[gte.name] = self.flight[root[index]]

  def cond(self, eqn, env, sizes, out) -> None:
    """The costliest branch, inlined."""
    branches = eqn.params["branches"]
    best = None
    for k, branch in enumerate(branches):
      before = set(self.computations)
      instrs: list[HloInstruction] = []
      invars, outvars = traced.open_vars(branch)
      branch_env = {i: env[o] for i, o in zip(invars, eqn.invars[1:])
                    if _is_var(o) and o in env}
      self.emit(branch, branch_env, sizes, instrs)
      made = set(self.computations) - before
      seconds = self.seconds(instrs)
      if best is None or seconds > best[0]:
        if best is not None:
          self._drop(best[4])
        best = (seconds, k, instrs, (branch_env, outvars), made)
      else:
        self._drop(made)
    _, k, instrs, (branch_env, outvars), _ = best
    out += instrs
    for o, i in zip(eqn.outvars, outvars):
      if _is_var(i) and i in branch_env:
        env[o] = branch_env[i]
    if len(branches) > 1:
      where = traced.source_line(eqn)
      at = f" at {where[0]}:{where[1]}" if where else ""
      self.conds.setdefault((at, len(branches)), collections.Counter())[k] += 1

  def notes(self) -> list[str]:
    notes = []
    for (at, n), chosen in self.conds.items():
      which = ", ".join(f"branch {k}" + (f" in {c}" if len(chosen) > 1 else "")
                        for k, c in chosen.most_common())
      times = sum(chosen.values())
      notes.append(f"A cond{at} has {n} branches; the costliest ({which}) is "
                   f"modelled{f' ({times} conds)' if times > 1 else ''}.")
    return notes

  def _drop(self, names) -> None:
    for name in names:
      self.computations.pop(name, None)

  def seconds(self, instrs: list[HloInstruction]) -> float:
    """Modelled seconds of `instrs` run one after another, loops included:
    how a cond's branches are ranked."""
    total = 0.0
    for instr in instrs:
      if instr.name in self.costs:
        total += self.model.roofline(*self.costs[instr.name])
      elif instr.name in self.comm:
        total += self.model.collective_seconds(*self.comm[instr.name])
      elif instr.opcode == "while":
        trip = attrs.known_trip_count(instr)
        total += (1 if trip is None else trip) * sum(
            self.seconds(self.computations[c].instructions)
            for c in instr.callees("body", "condition"))
    return total


def _scalar(eqn) -> bool:
  """Arithmetic on scalars alone (loop counters, indices): free."""
  return not any(traced.sub_jaxprs(v) for v in eqn.params.values()) and all(
      getattr(getattr(v, "aval", None), "shape", None) == ()
      for v in list(eqn.invars) + list(eqn.outvars))


def _costs(eqn) -> tuple[float, float]:
  """(flops, bytes) of one equation, from its shapes."""
  name = eqn.primitive.name
  estimate = eqn.params.get("cost_estimate")
  if estimate is not None and hasattr(estimate, "bytes_accessed"):
    return float(estimate.flops), float(estimate.bytes_accessed)
  ins = [traced.aval_bytes(v.aval) for v in eqn.invars]
  outs = sum(traced.aval_bytes(v.aval) for v in eqn.outvars)
  if name in _READS_ITS_RESULT:
    nbytes = 2 * outs
  elif name in _UPDATE_OPERAND and len(ins) > _UPDATE_OPERAND[name]:
    nbytes = 2 * ins[_UPDATE_OPERAND[name]]
  else:
    nbytes = sum(ins) + outs
  return traced.flops(eqn), nbytes
