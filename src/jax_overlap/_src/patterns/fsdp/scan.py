"""`fsdp_scan`: a stack of layers whose weight gathers hide behind compute."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_overlap._src import _compat
from jax_overlap._src.patterns.fsdp.transfer import (LeafLayout,
                                                     ReshardTransfer,
                                                     ShardMapTransfer)
from jax_overlap._src.patterns.fsdp.weight_split import split_by_weights


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
    layer: `layer(x, layer_params) -> x`, the same structure and types out as
      in. It must not close over values to be differentiated (pass them in
      `x` or `params`).
    x: the input of the first layer (any pytree).
    params: a pytree whose leaves are stacked along a leading layer dimension
      (any number of layers >= 1), each sharded over `axis` along one other
      dimension.
    axis: the mesh axis name the weights are sharded over, or a tuple of
      names (e.g. `("data", "fsdp")`, ZeRO-3 over the whole mesh).
    shard_dims: in shard_map only: the sharded dimension of each leaf of
      `params` (counting the layer dimension): one int for all leaves, or a
      pytree of ints like `params`. Default 1, the first dimension after the
      layer dimension.
    unroll: how many layers each iteration of the underlying `lax.scan` runs.
    remat_policy: a `jax.checkpoint` policy: the layer is recomputed in the
      backward pass as it says, instead of saving all its activations.

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
  n_layers = _n_layers(params)
  transfer = _transfer(axis, params, shard_dims)
  if isinstance(transfer, ReshardTransfer):
    transfer.reduced = transfer.reduced_axes(layer, x, _layer(params, 0))

  def forward(x, params, save: bool):
    def run_layer(x, w):
      if not save:
        return layer(x, w), None
      return _layer_forward(layer, remat_policy, x, w)

    def body(carry, i):   # i: the layer whose weights to prefetch
      x, w = carry
      (x, saved), w_next, _ = transfer.step(lambda: run_layer(x, w),
                                            gather=_layer(params, i))
      return (x, w_next), saved

    first = transfer.gather_now(_layer(params, 0))
    (x, w_last), saved = lax.scan(body, (x, first), jnp.arange(1, n_layers),
                                  unroll=unroll)
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
    backward = lambda pullback, w, y_bar: _layer_backward(layer, pullback, w,
                                                          y_bar)
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

    (x_bar, w, pending, grads), _ = lax.scan(
        body, (x_bar, w, pending, grads), jnp.arange(n_layers - 2, 0, -1),
        unroll=unroll)
    (x_bar, g0), _, g1 = transfer.step(
        lambda: backward(_layer(saved, 0), w, x_bar), scatter=pending)
    grads = put(put(grads, g1, 1), transfer.scatter_now(g0), 0)
    return x_bar, grads

  run.defvjp(run_fwd, run_bwd)
  return run(x, params)


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


def _layer_backward(layer, pullback, w, y_bar):
  """x's cotangent and the full weights' gradient, from a saved pullback
  (which already recomputes what the remat policy did not save)."""
  split = split_by_weights(layer, y_bar, w)
  frontier, prep_pullback = jax.vjp(split.prep, w)
  leaves, tree = jax.tree.flatten(pullback,
                                  is_leaf=lambda v: isinstance(v, _Slot))
  leaves = [frontier[v.index] if isinstance(v, _Slot) else v for v in leaves]
  x_bar, frontier_bar = jax.tree.unflatten(tree, leaves)(y_bar)
  (w_bar,) = prep_pullback(frontier_bar)
  return x_bar, w_bar


# --- arguments ---------------------------------------------------------------------------

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
    return ShardMapTransfer(axis if len(axes) > 1 else axes[0],
                            _local_dims(params, shard_dims))
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

def _local_dims(params, shard_dims):
  """Per-layer sharded dimension of each leaf, inside shard_map."""
  dims = 1 if shard_dims is None else shard_dims
  if isinstance(dims, int):
    dims = jax.tree.map(lambda _: dims, params)
  try:
    pairs = jax.tree.map(lambda d, p: (d, p), dims, params)
  except ValueError:
    raise ValueError(
        "fsdp_scan(shard_dims=...) must be one int or a pytree of ints shaped "
        f"like params; got {shard_dims!r} for params of structure "
        f"{jax.tree.structure(params)}.") from None

  def check(pair):
    d, p = pair
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d < jnp.ndim(p):
      raise ValueError(
          f"fsdp_scan(shard_dims=...): {d!r} is not a dimension after the "
          f"layer dimension of a leaf of shape {jnp.shape(p)} (give 1 to "
          f"{jnp.ndim(p) - 1}).")
    return d - 1
  return jax.tree.map(check, pairs, is_leaf=lambda v: isinstance(v, tuple))


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
