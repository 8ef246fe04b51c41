"""`fsdp_scan`: a stack of layers whose weight gathers hide behind compute."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax.sharding import PartitionSpec as P

from jax_overlap._src import _compat
from jax_overlap._src.patterns.fsdp.transfer import (LeafLayout,
                                                     ReshardTransfer,
                                                     ShardMapTransfer)
from jax_overlap._src.patterns.fsdp.weight_split import (split_by_weights,
                                                         trace_layer)


def fsdp_scan(layer: Callable[[Any, Any], Any], x, params, *, axis,
              shard_dims=None, unroll: int = 2, remat_policy=None):
  """Applies `layer` once per layer of `params`, prefetching the next weights.

  Fully sharded data parallelism over a scanned stack of layers: each layer's
  weights live sharded over mesh axis `axis`, are gathered just before use,
  and the gather of layer i+1 is in flight while layer i computes (double
  buffering). In the backward pass the gather of layer i-1 and the
  reduce-scatter of layer i+1's weight gradient are in flight while layer i's
  backward computes. Every step is fenced with `program_order`, so XLA cannot
  undo the overlap. Gathered weights are never saved for the backward pass
  (nor values computed from them alone, such as a cast): the residuals are
  activations only, and the backward pass gathers the weights again.

  Two contexts, one function:

  * inside `jax.shard_map` over `axis`: the leaves of `params` are the local
    shards; `shard_dims` says which dimension of each is sharded, and the
    transfers are `all_gather_start` / `psum_scatter_start` futures;
  * on an explicit-sharding mesh (`AxisType.Explicit`), outside shard_map:
    the sharded dimensions are read from each leaf's sharding, a gather is
    `jax.reshard` to the leaf's spec without the fsdp axes (other axes,
    such as tensor parallelism's, stay: a matmul contracting over them
    needs `out_sharding=` in the layer, as in plain jax) and a
    reduce-scatter is resharding the gradient back. A leaf replicated over
    the fsdp axes is used as it is.

  Args:
    layer: `layer(x, layer_params) -> x`, the same structure, shapes and
      dtypes out as in (checked at the call). It may be a `jax.jit`-wrapped
      function (its body is split like any other), and it may close over
      traced values, even ones being differentiated: they are lifted into
      explicit inputs, and their gradients flow (values computed from them
      and the weights together are then saved like activations).
    x: the input of the first layer (any pytree; integer, boolean and PRNG
      key parts get float0 gradients, as in jax).
    params: a pytree (dicts, tuples, lists, registered dataclasses, flax
      variables) whose leaves are stacked along a leading layer dimension
      (any number of layers >= 1), each sharded over `axis` along one other
      dimension, or kept replicated (see `shard_dims`).
    axis: the mesh axis name the weights are sharded over, or a tuple of
      names (e.g. `("data", "fsdp")`, ZeRO-3 over the whole mesh).
    shard_dims: in shard_map only: the sharded dimension of each leaf of
      `params` (counting the layer dimension): one int for all leaves, or a
      pytree of ints like `params` (or a prefix of it), with None for a leaf
      kept replicated: used as is, never gathered, its gradient reduced over
      the axis by autodiff as for any replicated shard_map input (not twice).
      Default: 1, the first dimension after the layer dimension, except for
      a leaf whose type says it does not vary over `axis` (in_specs left it
      replicated, e.g. `P()`), which is kept replicated; without vma tracking
      (`shard_map(..., check_vma=False)`) that cannot be seen, so say None
      there. On an explicit-sharding mesh a leaf whose sharding does not
      mention `axis` is kept replicated the same way.
    unroll: how many layers each iteration of the underlying `lax.scan` runs.
    remat_policy: a `jax.checkpoint` policy (a function such as
      `jax.checkpoint_policies.nothing_saveable`, not its name): the layer
      is recomputed in the backward pass as it says, instead of saving all
      its activations.

  Returns:
    The output of the last layer. Its gradients with respect to `params` come
    back sharded exactly like `params`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jax_overlap import fsdp_scan
    >>> mesh = jax.make_mesh((2,), ("d",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def layer(x, w):
    ...   return jnp.tanh(x @ w)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(None, "d")),
    ...                out_specs=P("d"))
    ... def model(x, ws):            # ws: this device's shard of each layer
    ...   return fsdp_scan(layer, x, ws, axis="d")
    >>> x, ws = jnp.ones((4, 8)), jnp.full((3, 8, 8), 0.1)   # 3 layers
    >>> model(x, ws).shape
    (4, 8)
  """
  if not callable(layer):
    raise TypeError(f"fsdp_scan(layer=...) must be a function "
                    f"layer(x, layer_params) -> x, got {layer!r}.")
  if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
    raise ValueError(f"fsdp_scan(unroll=...) must be an int >= 1, got {unroll!r}.")
  _check_remat_policy(remat_policy)
  n_layers = _n_layers(params)
  transfer = _transfer(axis, params, shard_dims)
  if isinstance(transfer, ReshardTransfer):
    transfer.reduced = transfer.reduced_axes(layer, x, _layer(params, 0))
  layer, hoisted = _traced_layer(layer, x, transfer, _layer(params, 0), n_layers)
  if hoisted:
    # The layer closed over traced values (perhaps being differentiated):
    # they ride along in the carry, so their gradients flow like x's.
    y, _ = _fsdp_scan(layer, (x, hoisted), params, n_layers, transfer,
                      unroll, remat_policy)
    return y
  return _fsdp_scan(layer, x, params, n_layers, transfer, unroll, remat_policy)


def _fsdp_scan(layer, x, params, n_layers, transfer, unroll, remat_policy):
  x_avals = []   # x's types as one layer sees them (for the backward's trace)

  def forward(x, params, save: bool):
    def run_layer(x, w):
      if not save:
        return layer(x, w), None
      x_avals[:] = [jax.tree.map(jax.typeof, x)]
      return _layer_forward(layer, remat_policy, x, w)

    def body(carry, i):   # i: the layer whose weights to prefetch
      x, w = carry
      (x, saved), w_next, _ = transfer.step(lambda: run_layer(x, w),
                                            gather=_layer(params, i))
      return (x, w_next), saved

    first = transfer.gather_now(_layer(params, 0))
    (x, w_last), saved = _scan_remainder_first(
        body, (x, first), jnp.arange(1, n_layers), unroll)
    (x, saved_last), _, _ = transfer.step(lambda: run_layer(x, w_last))
    return x, (saved, saved_last)

  @jax.custom_vjp
  def run(x, params):
    return forward(x, params, save=False)[0]

  def run_fwd(x, params):
    y, saved = forward(x, params, save=True)
    return y, (saved, params)

  def run_bwd(residuals, y_bar):
    # `saved` holds the pullbacks of layers 0 .. n-2, `saved_last` layer n-1's.
    (saved, saved_last), params = residuals
    backward = lambda pullback, w, y_bar: _layer_backward(
        layer, pullback, w, x_avals[0], y_bar)
    grads = jax.tree.map(jnp.zeros_like, params)
    put = lambda grads, g, i: jax.tree.map(
        lambda G, g: lax.dynamic_update_index_in_dim(G, g, i, 0), grads, g)

    w = transfer.gather_now(_layer(params, n_layers - 1))
    if n_layers == 1:
      x_bar, g = backward(saved_last, w, y_bar)
      return x_bar, put(grads, transfer.scatter_now(g), 0)

    (x_bar, pending), w, _ = transfer.step(
        lambda: backward(saved_last, w, y_bar),
        gather=_layer(params, n_layers - 2))

    def body(carry, i):   # layer i's backward; prefetch i-1, scatter i+1
      x_bar, w, pending, grads = carry
      (x_bar, g), w_prev, done = transfer.step(
          lambda: backward(_layer(saved, i), w, x_bar),
          gather=_layer(params, i - 1), scatter=pending)
      return (x_bar, w_prev, g, put(grads, done, i + 1)), None

    (x_bar, w, pending, grads), _ = _scan_remainder_first(
        body, (x_bar, w, pending, grads), jnp.arange(n_layers - 2, 0, -1),
        unroll)
    (x_bar, g0), _, g1 = transfer.step(
        lambda: backward(_layer(saved, 0), w, x_bar), scatter=pending)
    grads = put(put(grads, g1, 1), transfer.scatter_now(g0), 0)
    return x_bar, grads

  run.defvjp(run_fwd, run_bwd)
  return run(x, params)


def _scan_remainder_first(body, carry, xs, unroll: int):
  """`lax.scan(body, carry, xs, unroll=unroll)`, with the `len(xs) % unroll`
  iterations that do not fill a loop trip run first, unrolled, not after the
  loop as lax.scan runs them.

  Why: XLA's CPU runtime starts a collective that follows a while loop as
  soon as the loop has started, when the collective's operands do not come
  from the loop (our barriers order it in the HLO schedule, but the runtime
  drops barriers), and jax gives every collective the same channel id, which
  keys the rendezvous. The remainder's gathers read only the params, so they
  met the loop's gathers in one rendezvous: the process aborted ("Check
  failed: id < num_threads"), hung, or crashed. Collectives before a loop
  have finished when it starts. See benchmarks/repro_cpu_loop_collectives.py.
  """
  length = jax.tree.leaves(xs)[0].shape[0]
  head = length % unroll
  if not head:
    return lax.scan(body, carry, xs, unroll=unroll)
  split = lambda lo, hi: jax.tree.map(lambda a: a[lo:hi], xs)
  carry, ys_head = lax.scan(body, carry, split(0, head), unroll=True)
  if head == length:
    return carry, ys_head
  carry, ys = lax.scan(body, carry, split(head, length), unroll=unroll)
  return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys_head, ys)


# --- one layer, forward and backward -------------------------------------------------

def _layer(stacked, i):
  """Layer `i` of a stacked pytree, read in place (no copy of the stack)."""
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False),
                      stacked)


class _Slot:
  """Stands in a saved pullback for frontier value `index`, which is not
  saved: the backward pass computes it again from the regathered weights."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index

  def __repr__(self):
    return f"_Slot({self.index})"


jax.tree_util.register_pytree_node(_Slot, lambda s: ((), s.index),
                                   lambda index, _: _Slot(index))


def _rest_fn(split, remat_policy):
  if remat_policy is None:
    return split.rest
  return jax.checkpoint(split.rest, policy=remat_policy)


def _layer_forward(layer, remat_policy, x, w):
  """The layer's output and its pullback, with every value the weights alone
  determine left out (a `_Slot` in its place)."""
  split = split_by_weights(layer, x, w)
  frontier = split.prep(w)
  y, pullback = jax.vjp(_rest_fn(split, remat_policy), x, frontier)
  leaves, tree = jax.tree.flatten(pullback)
  ids = {id(f): k for k, f in enumerate(frontier)}
  leaves = [_Slot(ids[id(leaf)]) if id(leaf) in ids else leaf for leaf in leaves]
  return y, jax.tree.unflatten(tree, leaves)


def _layer_backward(layer, pullback, w, x_avals, y_bar):
  """x's cotangent and the full weights' gradient, from a saved pullback
  (which already recomputes what the remat policy did not save).

  The layer is traced again on x's own types, not on the cotangent's: an
  integer, boolean or PRNG-key part of x has a float0 cotangent, which the
  layer could not index, compare or split with."""
  split = split_by_weights(layer, x_avals, w)
  frontier, prep_pullback = jax.vjp(split.prep, w)
  leaves, tree = jax.tree.flatten(pullback,
                                  is_leaf=lambda v: isinstance(v, _Slot))
  leaves = [frontier[v.index] if isinstance(v, _Slot) else v for v in leaves]
  x_bar, frontier_bar = jax.tree.unflatten(tree, leaves)(y_bar)
  (w_bar,) = prep_pullback(frontier_bar)
  return x_bar, w_bar


# --- arguments ---------------------------------------------------------------------------

def _check_remat_policy(policy):
  if policy is None or callable(policy):
    return
  hint = ""
  if isinstance(policy, str):
    names = sorted(n for n in dir(jax.checkpoint_policies)
                   if n.endswith("saveable") and not n.startswith("_"))
    hint = (" Pass the policy itself, not its name: one of "
            + ", ".join(f"jax.checkpoint_policies.{n}" for n in names) + ".")
  raise TypeError(
      f"fsdp_scan(remat_policy=...) must be a jax.checkpoint policy (a "
      f"function) or None, got {policy!r}.{hint}")


def _short(v) -> str:
  aval = v if isinstance(v, jax_core.AbstractValue) else jax.typeof(v)
  return aval.str_short() if hasattr(aval, "str_short") else str(aval)


def _shapes(tree) -> str:
  return ", ".join(f"{jax.tree_util.keystr(k) or '.'} {_short(v)}"
                   for k, v in jax.tree_util.tree_leaves_with_path(tree))


def _traced_layer(layer, x, transfer, shards, n_layers):
  """Traces `layer` once on x and one gathered layer's weights: checks that
  it accepts them and returns x's structure and types, and lifts the traced
  values it closes over. Returns `(layer, hoisted)`: with `hoisted` empty the
  user's layer as it is; else `layer((x, hoisted), w) -> (y, hoisted)`."""
  w_avals = jax.make_jaxpr(transfer.gather_now)(shards).out_avals
  w_avals = jax.tree.unflatten(jax.tree.structure(shards), w_avals)
  x_leaves, x_tree = jax.tree.flatten(x)
  x_avals = [jax.typeof(v) for v in x_leaves]
  try:
    closed, out_tree = trace_layer(
        layer, jax.tree.unflatten(x_tree, x_avals), w_avals)
  except Exception as e:  # noqa: BLE001 - re-raised with what fsdp_scan gave it
    raise ValueError(
        f"fsdp_scan(layer=..., params=...): the layer fails on x and one "
        f"layer's weights ({type(e).__name__}: {e}). fsdp_scan reads the "
        f"leading dimension of every leaf of params as the layer dimension "
        f"({n_layers} layers here) and calls layer(x, params[i]) with "
        f"x: {_shapes(x)} and params[i]: {_shapes(w_avals)}. If params hold "
        "one layer's weights, stack them with a leading layer dimension "
        "(e.g. jax.tree.map(lambda a: a[None], params)).") from e
  out_avals = list(closed.out_avals)
  same = out_tree == x_tree and all(
      a.shape == b.shape and a.dtype == b.dtype
      for a, b in zip(out_avals, x_avals))
  if not same:
    raise ValueError(
        "fsdp_scan(layer=...) must return the same structure, shapes and "
        "dtypes as its input x (it is applied layer after layer): x is "
        f"{x_tree} with {[_short(a) for a in x_avals]}, the layer "
        f"returns {out_tree} with "
        f"{[_short(a) for a in out_avals]} (given params[i]: "
        f"{_shapes(w_avals)}, of {n_layers} layers: if params hold one "
        "layer's weights, stack them with a leading layer dimension).")

  consts = _compat.jaxpr_consts(closed)
  traced = [k for k, c in enumerate(consts) if isinstance(c, jax_core.Tracer)]
  if not traced:
    return layer, []
  jaxpr = _compat.open_jaxpr(closed)

  def lifted(carry, w):
    x, hoisted = carry
    values = list(consts)
    for k, h in zip(traced, hoisted, strict=True):
      values[k] = h
    out = jax_core.eval_jaxpr(jaxpr, values, *jax.tree.leaves(x),
                             *jax.tree.leaves(w))
    return jax.tree.unflatten(x_tree, out), hoisted
  return lifted, [consts[k] for k in traced]



def _n_layers(params) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise ValueError("fsdp_scan(params=...) has no arrays: give it the "
                     "stacked weights of at least one layer.")
  sizes = {}
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if len(shape) < 2:
      raise ValueError(
          f"fsdp_scan(params=...): leaf {jax.tree_util.keystr(path)} has "
          f"shape {shape}; every leaf needs a leading layer dimension and a "
          "sharded dimension after it.")
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(
        "fsdp_scan(params=...): the leading (layer) dimension differs between "
        f"leaves: {sizes}. Stack every parameter over the same layers.")
  n = next(iter(sizes.values()))
  if n < 1:
    raise ValueError("fsdp_scan(params=...) holds 0 layers; it needs at least 1.")
  return n


def _transfer(axis, params, shard_dims):
  axes = _axis_names(axis)
  bound = _compat.bound_axis_names()
  if bound is not None and all(a in bound for a in axes):
    return ShardMapTransfer(axes if len(axes) > 1 else axes[0],
                            _local_dims(params, shard_dims, axes))
  if bound and any(a in bound for a in axes):
    raise NameError(
        f"fsdp_scan(axis={axis!r}): {_in_scope(axes, bound)} Give only axes "
        "the enclosing jax.shard_map binds.")
  return ReshardTransfer(axes, _explicit_layouts(axis, axes, bound, params,
                                                 shard_dims))


def _axis_names(axis) -> tuple:
  """`axis` as a tuple of mesh axis names (one name, or a tuple of them)."""
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  if not axes or not all(isinstance(a, str) for a in axes) \
      or len(set(axes)) != len(axes):
    raise TypeError(
        f"fsdp_scan(axis=...) must be a mesh axis name or a tuple of distinct "
        f"names, got {axis!r}.")
  return axes


def _has_axes(mesh, axes) -> bool:
  names = getattr(mesh, "axis_names", None) or ()
  return all(a in names for a in axes)


def _in_scope(axes, bound, mesh=None) -> str:
  """Which of `axes` is not in scope, and what is."""
  known = set(bound or ()) | set(getattr(mesh, "axis_names", ()) or ())
  missing = [a for a in axes if a not in known]
  parts = []
  if bound:
    parts.append(f"the enclosing jax.shard_map binds {tuple(sorted(bound))}")
  if mesh is not None and getattr(mesh, "axis_names", ()):
    parts.append(f"the leaves' mesh has axes {tuple(mesh.axis_names)}")
  where = "; ".join(parts)
  name = ", ".join(repr(a) for a in missing)
  return f"no mesh axis named {name} here: {where}."


def _local_dims(params, shard_dims, axes):
  """Per-layer sharded dimension of each leaf of `params` (flattened) inside
  shard_map; None for a leaf kept replicated over `axes`."""
  leaves = jax.tree.leaves(params)
  if shard_dims is None:
    # A leaf whose type says it does not vary over `axes` (shard_map's
    # in_specs left it replicated, e.g. P()) is used as is; where this trace
    # does not track varying axes (check_vma=False), every leaf is gathered
    # along dimension 1 unless shard_dims says otherwise.
    def default(p):
      vma = _compat.varying_axes(p)
      return None if vma is not None and not vma & set(axes) else 1
    dims = [default(p) for p in leaves]
  elif isinstance(shard_dims, int) and not isinstance(shard_dims, bool):
    dims = [shard_dims] * len(leaves)
  else:
    # A pytree of ints (or None) shaped like params, or a prefix of it.
    is_none = lambda d: d is None
    try:
      subtrees = jax.tree.structure(shard_dims, is_leaf=is_none).flatten_up_to(
          params)
    except (ValueError, TypeError):
      raise ValueError(
          "fsdp_scan(shard_dims=...) must be one int or a pytree of ints "
          "shaped like params (None for a leaf kept replicated); got "
          f"{shard_dims!r} for params of structure "
          f"{jax.tree.structure(params)}.") from None
    dims = [d for d, sub in zip(jax.tree.leaves(shard_dims, is_leaf=is_none),
                                subtrees)
            for _ in jax.tree.leaves(sub)]

  def check(d, p):
    if d is None:
      return None
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d < jnp.ndim(p):
      raise ValueError(
          f"fsdp_scan(shard_dims=...): {d!r} is not a dimension after the "
          f"layer dimension of a leaf of shape {jnp.shape(p)} (give 1 to "
          f"{jnp.ndim(p) - 1}, or None for a leaf kept replicated).")
    return d - 1
  return [check(d, p) for d, p in zip(dims, leaves, strict=True)]


def _explicit_layouts(axis, axes, bound, params, shard_dims):
  """Per-layer `LeafLayout` of each leaf, on an explicit-sharding mesh."""
  if shard_dims is not None:
    raise ValueError(
        "fsdp_scan(shard_dims=...) is for use inside jax.shard_map; on an "
        "explicit-sharding mesh the sharded dimension is read from each "
        f"leaf's sharding. Drop shard_dims (got {shard_dims!r}).")
  over = axes[0] if len(axes) == 1 else axes
  how = (f"Call fsdp_scan inside jax.shard_map over {over!r}, or on an "
         "explicit-sharding mesh (jax.sharding.AxisType.Explicit) with the "
         f"leaves sharded over {over!r}.")

  def layout_of(path, p):
    where = jax.tree_util.keystr(path) or "(params itself)"
    sharding = getattr(jax.typeof(p), "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    # A concrete array (eager call) also says how it really is sharded.
    actual = getattr(p, "sharding", None) if not isinstance(p, jax.core.Tracer) \
        else None
    actual_mesh = getattr(actual, "mesh", None)
    if not _has_axes(mesh, axes) and _has_axes(actual_mesh, axes):
      mesh = actual_mesh
    if spec is None or not _has_axes(mesh, axes):
      if bound or getattr(mesh, "axis_names", ()):
        raise NameError(
            f"fsdp_scan(axis={axis!r}): {_in_scope(axes, bound, mesh)} Give "
            "axis= the mesh axis (or tuple of axes) the weights are sharded "
            "over.")
      raise ValueError(
          f"fsdp_scan(axis={axis!r}): leaf {where} is not sharded over a mesh "
          f"axis {over!r}. {how} (Here no axis is in scope: not inside "
          "jax.shard_map, and the leaves are on no mesh.)")
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    auto = [a for a in axes if "Explicit" not in str(types.get(a, "Explicit"))]
    if auto:
      said = (f"its sharding is {actual.spec}" if hasattr(actual, "spec")
              else "its type records no sharding over it")
      raise ValueError(
          f"fsdp_scan(axis={axis!r}): leaf {where} is on a mesh whose axis "
          f"{auto[0]!r} is {types[auto[0]]} ({said}): jax keeps shardings over "
          "Auto axes out of the types, so outside shard_map fsdp_scan cannot "
          "read how the leaf is sharded. Make the mesh with axis_types="
          "(jax.sharding.AxisType.Explicit, ...) and jax.set_mesh it, or call "
          f"fsdp_scan inside jax.shard_map over {over!r}.")
    entries = tuple(spec) + (None,) * (jnp.ndim(p) - len(spec))
    if entries[0] is not None:
      raise ValueError(
          f"fsdp_scan: leaf {where} has sharding spec {spec}: its layer "
          f"dimension (the first) is sharded over {entries[0]!r}. fsdp_scan "
          "reads one layer at a time: keep the layer dimension unsharded and "
          "shard a dimension after it.")
    return LeafLayout(P(*entries[1:]), axes)
  return jax.tree_util.tree_map_with_path(layout_of, params)
