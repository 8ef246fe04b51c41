"""The ends of the stack split by use order: layer 0's weights travel in
groups, each waited for right before the layer first reads it.

At the ends of a pass there is nothing to hide a whole layer's transfer
behind: the forward pass's first gather (layer 0's weights) and the backward
pass's last reduce-scatter (layer 0's gradient) sit beside an embedding
lookup and its scatter-add. But layer 0 itself does not need all its weights
at once: a block reads its first norm and QKV projection first, its output
projection after the attention, its MLP last. So layer 0's leaves are
gathered in groups, in the order the layer first reads them, cut at the
matmuls (`dot_general`, convolutions): each group's gather is in flight
behind the matmuls that run before its first use, and only the first
group's gather waits for what runs before the stack. The backward pass is
the mirror: layer 0's gradients are finished in about the reverse order (the
MLP's first), and each group's reduce-scatter starts right after the
equation that finishes it (once the one before it is done: one in flight at
a time, as everywhere in the stack), in flight behind the rest of layer 0's
backward; only the last group's (the first norm's and projection's) is left
for `before`'s backward to hide.

How: the layer (its forward with residuals, or its backward) is traced to a
jaxpr on layer 0's types; equations that read the weights alone (a cast, a
transpose) are moved to right before their first reader; the equations are
evaluated in that order inside one ordered `program_order` block, as free
blocks between the groups' `done()`s (forward) or `start`s (backward).
Buckets stay: each group is one collective per dtype, packed as
`buckets.py` packs a layer. Only inside `shard_map` (futures); on an
explicit mesh, with HSDP's backward, or when a layer yields one group (one
matmul, a `jax.jit`-wrapped or checkpointed body the trace does not open),
the stack's ends run as before.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, NamedTuple

import jax
from jax._src import core as jax_core

from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src import _compat
from jax_overlap._src.patterns.fsdp.layer_inputs import PairTransfer
from jax_overlap._src.patterns.fsdp.precision import Precision
from jax_overlap._src.patterns.fsdp.transfer import finish_moves
from jax_overlap._src.patterns.fsdp.weight_split import trace_layer

#: Whether fsdp_scan plans the split: on, but within `layer_0_whole()`.
_SPLIT = [True]

#: Equations that are compute worth hiding a transfer behind.
_HEAVY = frozenset({"dot_general", "conv_general_dilated", "ragged_dot",
                    "ragged_dot_general"})


@contextlib.contextmanager
def layer_0_whole():
  """Within it, `fsdp_scan` moves layer 0's weights whole (one bucket, like
  every other layer's), not split by use order.

  The split is on by default (chosen by measurement, docs/fsdp.md); this is
  the benchmarks' and tests' switch to measure or count the stack's ends as
  one collective (tests/patterns/fsdp/fsdp_knobs_test.py, benchmarks/
  bench_fsdp_knobs.py). Read when fsdp_scan is traced.

  >>> with layer_0_whole():
  ...   assert not split_wanted()
  >>> split_wanted()
  True
  """
  before, _SPLIT[0] = _SPLIT[0], False
  try:
    yield
  finally:
    _SPLIT[0] = before


def split_wanted() -> bool:
  """Whether fsdp_scan splits layer 0 by use order here (`layer_0_whole`)."""
  return _SPLIT[0]


# --- the layer's leaves, grouped ------------------------------------------------


class _Layer:
  """One layer's weights (or `(weights, xs_i)` pair), flat: which leaves
  travel (sharded over the axis) and how to move a subset of them."""

  def __init__(self, transfer, tree):
    self.pair = isinstance(transfer, PairTransfer)
    self.inner = transfer.inner if self.pair else transfer
    self.tree = tree
    self.n_w = len(jax.tree.leaves(tree[0] if self.pair else tree))
    self.moving = [d is not None for d in self.inner.dims]

  def _only(self, members):
    return self.inner.only(members)

  def _w(self, tree):
    return tree[0] if self.pair else tree

  def start_gather(self, shards, members):
    """The gathers of `members` started; `finish()` -> {position: value}."""
    pending = self._only(set(members)).gather_starts(self._w(shards))
    def finish():
      leaves = jax.tree.leaves(finish_moves(pending))
      return {k: leaves[k] for k in members}
    return finish

  def ready(self, shards) -> dict:
    """The leaves that are not gathered (replicated, xs_i), as the layer
    gets them."""
    leaves = jax.tree.leaves(self._only(set()).gather_starts(self._w(shards))
                             .finish())
    out = {k: a for k, a in enumerate(leaves) if not self.moving[k]}
    if self.pair:
      out.update({self.n_w + k: a
                  for k, a in enumerate(jax.tree.leaves(shards[1]))})
    return out

  def start_scatter(self, grads, members):
    """The reduce-scatters of `members` (full gradients, flat positions)
    started; `finish()` -> {position: gradient shard in its own dtype}."""
    only = self._only(set(members))
    pending = only.scatter_starts(self._w(grads))
    def finish():
      leaves = jax.tree.leaves(finish_moves(pending))
      return {k: Precision.back_to(leaves[k], only.dtypes[k])
              for k in members}
    return finish

  def kept(self, grads) -> dict:
    """The gradients that are not reduce-scattered (replicated leaves,
    reduced by autodiff; xs_i's), as scatter_now returns them."""
    leaves = jax.tree.leaves(self.inner.own_dtypes(self._w(grads)))
    out = {k: a for k, a in enumerate(leaves) if not self.moving[k]}
    if self.pair:
      out.update({self.n_w + k: a
                  for k, a in enumerate(jax.tree.leaves(grads[1]))})
    return out

  def sharded(self) -> list[int]:
    return [k for k, m in enumerate(self.moving) if m]


# --- the traced layer, reordered ---------------------------------------------


def _reads_heavy(eqn) -> bool:
  if eqn.primitive.name in _HEAVY:
    return True
  return any(_jaxpr_heavy(j) for j in jax_core.jaxprs_in_params(eqn.params))


def _jaxpr_heavy(jaxpr) -> bool:
  return any(_reads_heavy(e) for e in jaxpr.eqns)


def _flops(eqn) -> float:
  """A heavy eqn's multiply-adds (its output's size times the size of
  what each output element contracts), nested ones summed; 0 for others."""
  if eqn.primitive.name in _HEAVY:
    return float(math.prod(eqn.outvars[0].aval.shape)) * _contracted(eqn)
  return sum(_flops(e) for j in jax_core.jaxprs_in_params(eqn.params)
             for e in j.eqns)


def _contracted(eqn) -> float:
  if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
    (lc, _), _ = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return float(math.prod(shape[d] for d in lc))
  rhs = eqn.invars[1].aval.shape   # conv: kernel size times in-features
  return float(math.prod(rhs)) / max(1, rhs[-1] if rhs else 1)


class _Traced(NamedTuple):
  jaxpr: Any
  consts: list
  out_tree: Any
  order: list      # the eqns, weight-only ones moved next to their reader
  n_x: int


def _trace(fn, x, w) -> _Traced:
  closed, out_tree = trace_layer(fn, x, w)
  jaxpr = _compat.open_jaxpr(closed)
  n_x = len(jax.tree.leaves(x))
  return _Traced(jaxpr, _compat.jaxpr_consts(closed), out_tree,
                 _lazy_weight_order(jaxpr, n_x), n_x)


def _lazy_weight_order(jaxpr, n_x: int) -> list:
  """The eqns in an order where each one that reads the weights alone (no
  value of x, no effect) runs right before its first reader, so that a
  weight's first use is where the layer's compute first needs it."""
  on_x = set(jaxpr.invars[:n_x])
  lazy, producer = [], {}
  for e in jaxpr.eqns:
    ins = [v for v in e.invars if not isinstance(v, jax_core.Literal)]
    if any(v in on_x for v in ins) or e.effects:
      on_x.update(e.outvars)
    else:
      lazy.append(e)
    for v in e.outvars:
      producer[v] = e
  lazy = set(map(id, lazy))
  order, placed = [], set()

  def place(e):
    if id(e) in placed:
      return
    placed.add(id(e))
    for v in e.invars:
      p = None if isinstance(v, jax_core.Literal) else producer.get(v)
      if p is not None and id(p) in lazy:
        place(p)
    order.append(e)

  for e in jaxpr.eqns:
    if id(e) not in lazy:
      place(e)
  for v in jaxpr.outvars:   # weight-only outputs, at the end
    p = None if isinstance(v, jax_core.Literal) else producer.get(v)
    if p is not None and id(p) in lazy:
      place(p)
  return order


def _groups_by_first_use(order, positions_vars, first_of) -> list[tuple]:
  """`positions_vars`: {leaf position: its var}; `first_of(var)`: an index
  into `order`. Returns `[[first index, last index, [positions]]]`, one per
  group, in order: a leaf starts a group of its own when a heavy eqn runs
  between the current group's last index and its own."""
  at = sorted((first_of(v), k) for k, v in positions_vars.items())
  groups = []   # [first index, last index, members]
  for i, k in at:
    if groups and not any(_reads_heavy(order[j])
                          for j in range(groups[-1][1], min(i, len(order)))):
      groups[-1][1] = i
      groups[-1][2].append(k)
    else:
      groups.append([i, i, [k]])
  return groups


def _paced(order, groups, g_vars) -> list:
  """Backward groups merged so that each reduce-scatter has its share of
  layer 0's backward behind it: the reduce-scatters run one at a time,
  layer 1's first, so layer 0's first group starts only once half of
  layer 0's backward flops have run (layer 1's reduce-scatter in flight
  over them), and each later group once the first half plus its share, by
  bytes, of the second half has run. A group that finishes earlier waits
  for the next (one collective for both). Shares, not times: nothing here
  knows the hardware's flops to bandwidth ratio."""
  done = [0.0]
  for e in order:
    done.append(done[-1] + _flops(e))
  total = done[-1]
  size = lambda k: math.prod(g_vars[k].aval.shape)
  all_bytes = sum(size(k) for g in groups for k in g[2]) or 1
  out, pending, started = [], [], 0
  for j, (first, last, members) in enumerate(groups):
    pending.extend(members)
    target = total / 2 * (1 + started / all_bytes)
    if done[min(last, len(order))] >= target or j == len(groups) - 1:
      out.append([first, last, pending])
      started += sum(size(k) for k in pending)
      pending = []
  return out


def _segments(order, cuts):
  """`order` cut before each index of `cuts` (ascending): the runs."""
  bounds = [0] + list(cuts) + [len(order)]
  return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _read(env, v):
  return v.val if isinstance(v, jax_core.Literal) else env[v]


def _live_after(order, start: int, outvars) -> set:
  live = {v for v in outvars if not isinstance(v, jax_core.Literal)}
  for e in order[start:]:
    live.update(v for v in e.invars if not isinstance(v, jax_core.Literal))
  return live


def _free(env, eqns, live: set):
  """`eqns` evaluated in a free block (XLA may reorder inside it); their
  outputs still read later are put in `env`."""
  if not eqns:
    return
  keep = [v for e in eqns for v in e.outvars
          if not isinstance(v, jax_core.DropVar) and v in live]

  def block():
    local = dict(env)
    for e in eqns:
      outs = _compat.bind_eqn(e, [_read(local, v) for v in e.invars])
      for v, o in zip(e.outvars, outs):
        local[v] = o
    return [local[v] for v in keep]
  env.update(zip(keep, program_order(enforce=False)(block)()))


# --- forward: layer 0 after before(), its gathers split ------------------------


def forward_first(transfer, run_layer, enter_compute, shards0, shards1):
  """One ordered block: layer 0's gathers started group by group, layer 1's
  gather after them (the link runs them in issue order), `before` run, then
  layer 0 evaluated with each group waited for right before its first use.
  Returns `(layer 0's output, its saved, before's saved, layer 1's
  weights)`, or None where the layer gives a single group (nothing gained:
  the caller runs the ends as one gather)."""
  layer = _Layer(transfer, shards0)
  carry_tree, carry_types = _types_of(lambda: enter_compute()[0])
  w_types = jax.make_jaxpr(transfer.gather_now)(shards0).out_avals
  w_types = jax.tree.unflatten(jax.tree.structure(shards0), w_types)
  traced = _trace(run_layer, jax.tree.unflatten(carry_tree, carry_types),
                  w_types)
  order, n_x = traced.order, traced.n_x
  w_vars = traced.jaxpr.invars[n_x:]
  first = {}
  for i, e in enumerate(order):
    for v in e.invars:
      if not isinstance(v, jax_core.Literal) and v not in first:
        first[v] = i
  first_of = lambda v: first.get(v, len(order))
  groups = _groups_by_first_use(
      order, {k: w_vars[k] for k in layer.sharded()}, first_of)
  if len(groups) < 2:
    return None

  @program_order(enforce=True)
  def ordered():
    finishes = [layer.start_gather(shards0, members)
                for _, _, members in groups]
    next_pending = transfer.inner.gather_starts(shards1[0]) \
        if isinstance(transfer, PairTransfer) else \
        transfer.gather_starts(shards1)
    carry, entered = program_order(enforce=False)(enter_compute)()
    env = dict(zip(traced.jaxpr.constvars, traced.consts))
    env.update(zip(traced.jaxpr.invars[:n_x], jax.tree.leaves(carry)))
    env.update({w_vars[k]: a for k, a in layer.ready(shards0).items()})
    pieces = _segments(order, [first for first, _, _ in groups])
    end = 0
    for j, piece in enumerate(pieces):
      if j:   # group j-1 is first read by this piece's first eqn
        env.update({w_vars[k]: a for k, a in finishes[j - 1]().items()})
      end += len(piece)
      _free(env, piece, _live_after(order, end, traced.jaxpr.outvars))
    out = jax.tree.unflatten(traced.out_tree,
                             [_read(env, v) for v in traced.jaxpr.outvars])
    w1 = finish_moves(next_pending)
    if isinstance(transfer, PairTransfer):
      w1 = (w1, shards1[1])
    return out, entered, w1
  (y, saved), entered, w1 = ordered()
  return y, saved, entered, w1


def _types_of(thunk):
  tree = []

  def flat():
    out = thunk()
    leaves, t = jax.tree.flatten(out)
    tree.append(t)
    return leaves
  closed = jax.make_jaxpr(flat)()
  return tree[0], list(closed.out_avals)


# --- backward: layer 0's gradients reduce-scattered as they are finished --------


def backward_first(transfer, backward, saved0, w0, x_bar, pending,
                   before_back: Callable):
  """One ordered block: layer 1's reduce-scatter started, layer 0's backward
  evaluated, each group of its gradients reduce-scattered right after the
  eqn that finishes it (once the previous reduce-scatter is done),
  `before_back(layer 0's x cotangent)` (before's backward) last, with the
  last group's reduce-scatter in flight. Returns
  `((before_back's result, layer 0's x cotangent), layer 0's gradient
  shards, layer 1's)`, or None
  where the gradients come in one group."""
  layer = _Layer(transfer, w0)
  fn = lambda y_bar, pw: backward(pw[0], pw[1], y_bar)
  traced = _trace(fn, x_bar, (saved0, w0))
  order = traced.order
  outs = traced.jaxpr.outvars
  n_xbar = len(outs) - len(jax.tree.leaves(w0))
  g_vars = outs[n_xbar:]
  made = {}
  for i, e in enumerate(order):
    for v in e.outvars:
      made[v] = i
  # a gradient is finished after eqn made[v]: it can start before eqn +1
  finished = lambda v: 0 if isinstance(v, jax_core.Literal) \
      else made.get(v, -1) + 1
  groups = _groups_by_first_use(
      order, {k: g_vars[k] for k in layer.sharded()}, finished)
  groups = _paced(order, groups, g_vars)
  if len(groups) < 2:
    return None

  @program_order(enforce=True)
  def ordered():
    prev = transfer.inner.scatter_starts(pending[0]) \
        if isinstance(transfer, PairTransfer) else \
        transfer.scatter_starts(pending)
    env = dict(zip(traced.jaxpr.constvars, traced.consts))
    env.update(zip(traced.jaxpr.invars,
                   jax.tree.leaves(x_bar) + jax.tree.leaves((saved0, w0))))
    # One reduce-scatter in flight at a time, as in the rest of the stack:
    # each group's waits for the previous one (layer 1's first), so the
    # bytes in flight stay one layer's, and TPU's async form (an
    # all-to-all, one in flight at a time) stays async.
    in_flight, done = None, {}
    # (a gradient not made yet stands as its type: only members are read)
    pieces = _segments(order, [last for _, last, _ in groups])
    end = 0
    for j, piece in enumerate(pieces):
      if j:   # group j-1's gradients are finished: start their scatter
        grads = jax.tree.unflatten(jax.tree.structure(w0), [
            _read(env, v) if isinstance(v, jax_core.Literal) or v in env
            else v.aval for v in g_vars])
        if in_flight is None:
          g1 = finish_moves(prev)
        else:
          done.update(in_flight())
        in_flight = layer.start_scatter(grads, groups[j - 1][2])
      end += len(piece)
      _free(env, piece, _live_after(order, end, outs))
    x0, grads = jax.tree.unflatten(traced.out_tree,
                                   [_read(env, v) for v in outs])
    back = program_order(enforce=False)(lambda: before_back(x0))()
    done.update(layer.kept(grads))
    done.update(in_flight())
    g0 = jax.tree.unflatten(jax.tree.structure(w0),
                            [done[k] for k in range(len(g_vars))])
    g1 = transfer.inner.own_dtypes(g1) if isinstance(
        transfer, PairTransfer) else transfer.own_dtypes(g1)
    if isinstance(transfer, PairTransfer):
      g1 = (g1, pending[1])
    return (back, x0), g0, g1
  return ordered()
