"""Primitives that run whole inside an eager `jax.shard_map`.

An eager shard_map (one not under `jax.jit`) compiles and runs each primitive
of its body on its own, and compiles it again at every call (jax keeps no
cache across calls there). A collective start compiled alone would have its
done in another program, and an ordered block compiled alone could not hand
a started future to the code after it. So in an eager shard_map our
primitives are evaluated right away, on the shard_map's own values:

* a start runs its collective to the end (the done then hands the value
  over);
* a `program_order` block (a primitive made with `body_param`) runs as ONE
  compiled program (`jax.jit` of a `shard_map` over the trace's mesh), in
  which its starts are those synchronous collectives and nested blocks are
  inlined. Its order does not matter there: an eager call is for values.
  The program is cached on the body's structure (`_Fingerprint`), so that
  the next call, which traces a new but equal body, compiles nothing.

Everywhere else (jit, autodiff, vmap, eager calls outside shard_map) they
bind as usual. Pinned by tests/integration/real_clients_eager_test.py (no compile on a
second eager call; eager values and gradients equal jit's) and
tests/integration/modes_test.py (every mode, eager columns included).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax._src import config as jax_config
from jax._src import core
from jax._src import sharding_impls
from jax._src import shard_map as _shard_map
from jax._src.interpreters import ad, batching
from jax._src.interpreters import partial_eval as pe
from jax._src.mesh import use_abstract_mesh
from jax._src.shard_map import ShardMapTrace, ShardMapTracer

from jax_overlap._src import _compat


class EagerAwarePrimitive(core.Primitive):
  """A primitive with its own evaluation for eager shard_map bodies.

  `body_param`: the name of the param holding the body (a closed jaxpr) of
  a block primitive, which runs as one cached program there; None for a
  primitive with an eager rule (`def_eager_shard_map`)."""

  def __init__(self, name: str, *, body_param: str | None = None):
    super().__init__(name)
    self.body_param = body_param
    self.eager_rule: Callable[..., Any] | None = None
    self.replay_rule: Callable[..., None] | None = None
    self.cache_key_rule: Callable[..., Any] | None = None

  def def_eager_shard_map(self, rule: Callable[..., Any]) -> Callable[..., Any]:
    """`rule(*args, **params)` runs with the eager shard_map as current trace,
    and is traced into a block's one program."""
    self.eager_rule = rule
    return rule

  def def_replay(self, rule: Callable[..., None]) -> Callable[..., None]:
    """`rule(**params)`: what the eager rule does besides computing values
    (watching a future), done again when a cached program stands in for it."""
    self.replay_rule = rule
    return rule

  def def_cache_key(self, rule: Callable[..., Any]) -> Callable[..., Any]:
    """`rule(key, **params)` -> a hashable stand-in for params whose own
    equality is identity but whose meaning is structural (`key(x)` keys a
    sub-value, e.g. a jaxpr)."""
    self.cache_key_rule = rule
    return rule

  def bind_with_trace(self, trace, args, avals, params, /):
    if isinstance(trace, ShardMapTrace):
      if self.body_param is not None:
        return _run_block(trace, self, args, params)
      if self.eager_rule is not None:
        with core.set_current_trace(trace):
          return self.eager_rule(*args, **params)
    return super().bind_with_trace(trace, args, avals, params)


# --- a whole pattern as one block ----------------------------------------------------

def in_eager_shard_map() -> bool:
  """True where values are computed as they are bound, in an eager shard_map:
  the current trace is a `ShardMapTrace`, or autodiff / vmap traces over
  one. False under jit (and outside shard_map)."""
  trace = core.trace_ctx.trace
  while trace is not None:
    if isinstance(trace, ShardMapTrace):
      return True
    if not isinstance(trace, _EAGER_TRACES):
      return False
    trace = getattr(trace, "parent_trace", None)
  return False


_EAGER_TRACES = tuple(t for t in (getattr(ad, "JVPTrace", None),
                                  getattr(ad, "LinearizeTrace", None),
                                  getattr(batching, "BatchTrace", None))
                      if t is not None)


# --- a block as one cached program -------------------------------------------------

def _run_block(trace, prim, args, params):
  # Dead code goes first, as when the block is lowered (which is also where
  # a dropped future is found: DCE of an unused start raises).
  body = params[prim.body_param]
  n_out = len(_compat.open_jaxpr(body).outvars)
  body, used = _compat.dce(body, [True] * n_out, instantiate=True)
  args = [x for x, u in zip(args, used) if u]
  return run_in_one_program(trace, body, args)


def run_in_one_program(trace: ShardMapTrace, closed, args) -> list[Any]:
  """`closed(*args)` in the eager shard_map `trace`, as one compiled program.

  Invariant: the values are those of running `closed` one primitive at a
  time there; a second call with an equal body (`_Fingerprint`) and the same
  types compiles and traces nothing. Why: jax compiles every primitive of an
  eager shard_map body anew at each call."""
  consts = _compat.jaxpr_consts(closed)
  operands = [*consts, *args]
  if any(isinstance(x, core.Tracer) and not isinstance(x, ShardMapTracer)
         for x in operands):
    return _one_at_a_time(trace, closed, args)
  try:
    fingerprint = _Fingerprint.of(_compat.open_jaxpr(closed))
  except _Uncacheable:
    fingerprint = None
  vals, mats = zip(*map(trace.to_val_mat_pair, operands)) if operands \
      else ((), ())
  mesh = trace.mesh
  if trace.check:
    out_mats = [a.mat for a in closed.out_avals]
    in_specs = tuple(_shard_map._mat_to_spec(mesh, m) for m in mats)
    out_specs = tuple(_shard_map._mat_to_spec(mesh, m) for m in out_mats)
  else:
    out_mats = [core.empty_mat] * len(closed.out_avals)
    spec = jax.sharding.PartitionSpec(
        _shard_map.order_wrt_mesh(mesh, trace.manual_axes))
    in_specs, out_specs = (spec,) * len(operands), (spec,) * len(out_mats)
  key = (fingerprint, trace.check, mesh, trace.manual_axes, in_specs,
         out_specs)
  program = None if fingerprint is None else _PROGRAMS.get(key)
  if program is None:
    program = jax.jit(_OneProgram(closed, mesh, trace.manual_axes, trace.check,
                                  in_specs, out_specs))
    if fingerprint is not None:
      _PROGRAMS.put(key, program)
  else:
    _replay(_compat.open_jaxpr(closed))
  with (core.eval_context(), jax.disable_jit(False),
        jax_config.debug_nans(False), jax_config.debug_infs(False),
        use_abstract_mesh(trace.amesh),
        sharding_impls._internal_use_concrete_mesh(mesh)):
    out_vals = program(*vals)
  _shard_map._maybe_check_special(out_vals)
  return [ShardMapTracer(trace, m, v) for m, v in zip(out_mats, out_vals)]


def _one_at_a_time(trace, closed, args):
  with core.set_current_trace(trace):
    return core.jaxpr_as_fun(closed)(*args)


class _OneProgram:
  """The jitted function of one block: a shard_map of its eager evaluation."""

  def __init__(self, closed, mesh, manual_axes, check, in_specs, out_specs):
    # The consts come in as arguments: kept here, a cached program would
    # hold the first call's arrays alive.
    jaxpr = _compat.open_jaxpr(closed)
    if getattr(jaxpr, "consts", None):
      jaxpr = pe.convert_constvars_jaxpr(jaxpr)   # consts -> leading invars
    self.jaxpr = jaxpr
    self.mesh, self.manual_axes, self.check = mesh, manual_axes, check
    self.in_specs, self.out_specs = in_specs, out_specs
    self.__name__ = "eager_block"

  def __call__(self, *vals):
    def body(*vals):
      vals = [jax.lax.squeeze(x, [0]) for x in vals]
      n = len(self.jaxpr.constvars)   # 0 where the consts became invars
      outs = _evaluate(self.jaxpr, vals[:n], vals[n:])
      return [jax.lax.expand_dims(x, [0]) for x in outs]
    return jax.shard_map(body, mesh=self.mesh, in_specs=self.in_specs,
                         out_specs=list(self.out_specs), check_vma=self.check,
                         axis_names=self.manual_axes)(*vals)


def _evaluate(jaxpr, consts, args) -> list[Any]:
  """Evaluates `jaxpr` as an eager shard_map would, traced into one program:
  our primitives by their eager rules, nested blocks inlined (after DCE),
  every other equation bound as it is."""
  env: dict[Any, Any] = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for v, x in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args],
                  strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    prim, invals = eqn.primitive, [read(v) for v in eqn.invars]
    if isinstance(prim, EagerAwarePrimitive) and prim.body_param is not None:
      body = eqn.params[prim.body_param]
      n_out = len(_compat.open_jaxpr(body).outvars)
      body, used = _compat.dce(body, [True] * n_out, instantiate=True)
      outs = _evaluate(_compat.open_jaxpr(body), _compat.jaxpr_consts(body),
                       [x for x, u in zip(invals, used) if u])
    elif isinstance(prim, EagerAwarePrimitive) and prim.eager_rule is not None:
      outs = prim.eager_rule(*invals, **eqn.params)
      outs = list(outs) if prim.multiple_results else [outs]
    else:
      outs = _compat.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _replay(jaxpr) -> None:
  """Runs the replay rules of our primitives that `_evaluate` would reach."""
  for eqn in jaxpr.eqns:
    prim = eqn.primitive
    if not isinstance(prim, EagerAwarePrimitive):
      continue
    if prim.body_param is not None:
      _replay(_compat.open_jaxpr(eqn.params[prim.body_param]))
    elif prim.replay_rule is not None:
      prim.replay_rule(**eqn.params)


# --- the cache -----------------------------------------------------------------------

class _Programs:
  """A bounded LRU of compiled block programs. Each entry keeps its body
  alive, so an object keyed by identity in a fingerprint cannot be freed and
  its id reused while the entry lives."""

  def __init__(self, size: int):
    self.size = size
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def get(self, key):
    with self._lock:
      program = self._entries.get(key)
      if program is not None:
        self._entries.move_to_end(key)
      return program

  def put(self, key, program) -> None:
    with self._lock:
      self._entries[key] = program
      while len(self._entries) > self.size:
        self._entries.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


_PROGRAMS = _Programs(512)


class _Uncacheable(Exception):
  """The body holds something whose equality cannot be decided (a tracer)."""


# Params that only autodiff reads: the cached program is evaluated, never
# differentiated, so bodies that differ only in these compute the same.
_AUTODIFF_ONLY_PARAMS = {
    "custom_jvp_call": frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk"}),
    "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees"}),
    "custom_vjp_call_jaxpr": frozenset({"fwd_jaxpr_thunk", "bwd",
                                        "out_trees"}),
    "checkpoint": frozenset({"policy"}),
    "remat": frozenset({"policy"}),
}

_SMALL_ARRAY = 4096   # elements: constants up to this size are keyed by value


class _Fingerprint:
  """A hashable value equal for two jaxprs that compute the same.

  Variables are numbered by position; avals, primitives, equation contexts
  (interned by jax) and params by their own equality; sub-jaxprs
  recursively; small constants by value, others by identity; our
  primitives' params by their `def_cache_key` rule. Source locations are
  left out. Why: each eager call traces new jaxpr objects, which jax
  compares by identity."""

  @staticmethod
  def of(jaxpr) -> tuple:
    return _Fingerprint()._jaxpr(jaxpr)

  def __init__(self):
    self._memo: dict[int, Any] = {}

  def _jaxpr(self, jaxpr) -> tuple:
    memo = self._memo.get(id(jaxpr))
    if memo is not None:
      return memo[1]
    numbers: dict[Any, int] = {}

    def bind(v):
      numbers[v] = len(numbers)
      return _aval_key(v.aval)

    def ref(v):
      if isinstance(v, core.Literal):
        return ("lit", self.value(v.val), _aval_key(v.aval))
      return numbers[v]

    ins = tuple(bind(v) for v in [*jaxpr.constvars, *jaxpr.invars])
    eqns = []
    for eqn in jaxpr.eqns:
      invars = tuple(ref(v) for v in eqn.invars)
      outs = tuple(("drop", _aval_key(v.aval)) if isinstance(v, core.DropVar)
                   else bind(v) for v in eqn.outvars)
      eqns.append((eqn.primitive, invars, outs, self._params(eqn),
                   _hashable(eqn.effects), eqn.ctx))
    key = (ins, tuple(eqns), tuple(ref(v) for v in jaxpr.outvars),
           _hashable(jaxpr.effects))
    self._memo[id(jaxpr)] = (jaxpr, key)
    return key

  def _params(self, eqn) -> tuple:
    prim = eqn.primitive
    if isinstance(prim, EagerAwarePrimitive) and prim.cache_key_rule:
      return ("rule", prim.cache_key_rule(self.value, **eqn.params))
    skip = _AUTODIFF_ONLY_PARAMS.get(prim.name, ())
    return tuple((k, self.value(v)) for k, v in sorted(eqn.params.items())
                 if k not in skip)

  def value(self, x) -> Any:
    """The key of one param value or constant."""
    if isinstance(x, core.Tracer):
      raise _Uncacheable
    if isinstance(x, core.Jaxpr):   # (on jax 0.12 with its consts)
      return ("jaxpr", self._jaxpr(x),
              tuple(self.value(c) for c in getattr(x, "consts", ())))
    if _compat.is_closed(x):
      return ("closed", self._jaxpr(x.jaxpr),
              tuple(self.value(c) for c in x.consts))
    if isinstance(x, (tuple, list)):
      return (type(x), tuple(self.value(v) for v in x))
    if isinstance(x, dict):
      return (dict, tuple((k, self.value(v)) for k, v in sorted(
          x.items(), key=lambda kv: repr(kv[0]))))
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      if np.size(x) <= _SMALL_ARRAY and not jax.dtypes.issubdtype(
          x.dtype, jax.dtypes.extended):
        a = np.asarray(x)
        return ("array", type(x), a.shape, a.dtype.str, a.tobytes())
      return ("id", id(x))
    try:
      hash(x)
    except TypeError:
      return ("id", id(x))
    return ("value", type(x), x)


def _aval_key(aval):
  try:
    hash(aval)
  except TypeError:
    return ("id", id(aval))
  return aval


def _hashable(effects):
  if isinstance(effects, (set, frozenset)):
    effects = frozenset(effects)
  try:
    hash(effects)
  except TypeError:
    return ("id", id(effects))
  return effects
