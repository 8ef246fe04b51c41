"""What `fsdp_scan` is given: checked at the call, and turned into a transfer.

The number of layers, the remat policy, the axes (one name or a tuple), which
context it runs in (a `ShardMapTransfer` inside `jax.shard_map`, a
`ReshardTransfer` on an explicit-sharding mesh), each leaf's sharded
dimension or layout (replicated leaves included), and one trace of the layer
on x and a gathered layer's weights: it must keep x's types, and any traced
values it closes over are lifted into explicit inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax.sharding import PartitionSpec as P

from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async, permute_forms, tpu_forms
from jax_overlap._src.patterns.fsdp.explicit_futures import \
    FutureReshardTransfer
from jax_overlap._src.patterns.fsdp.transfer import (LeafLayout,
                                                     ReshardTransfer,
                                                     ShardMapTransfer)
from jax_overlap._src.patterns.fsdp.weight_split import trace_layer
from jax_overlap._src.patterns.fsdp.transfer_protocol import Transfer
from jax_overlap._src.patterns.varying import vary_over


def check_remat_policy(policy):
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


def _gather_hint(transfer) -> str:
  """Inside shard_map: which dimension each leaf was gathered along, and how
  to name another (a flax attention `out` kernel is sharded on its last
  dimension when heads < devices)."""
  if not transfer.in_shard_map:
    return ""
  dims = getattr(transfer, "inner", transfer).dims
  said = sorted({d + 1 for d in dims if d is not None})
  return (f" Each leaf was gathered along dimension "
          f"{', '.join(map(str, said)) or '(none)'} (counting the layer "
          "dimension): if a leaf is sharded along another, say which with "
          "shard_dims= (one int, or a pytree of ints like params, e.g. "
          "{'out': {'kernel': 3}} for a kernel sharded on its last "
          "dimension).")


def gathered_types(transfer, shards):
  """The types of one layer's weights once `transfer` has gathered them."""
  avals = jax.make_jaxpr(transfer.gather_now)(shards).out_avals
  return jax.tree.unflatten(jax.tree.structure(shards), avals)


def traced_layer(layer, x, transfer, shards, n_layers,
                 call: str = "layer(x, params[i])"):
  """Traces `layer` once on x and one gathered layer's weights: checks that
  it accepts them and returns x's structure and types, and lifts the traced
  values it closes over. Returns `(layer, hoisted, widen)`: with `hoisted`
  empty the user's layer as it is; else `layer((x, hoisted), w) -> (y,
  hoisted)`. `widen` is None, or for each leaf of x the mesh axes the
  layer's output varies over beyond x's own (`widen_carry`). `call`: how
  the user's layer is called, for the error message."""
  w_avals = gathered_types(transfer, shards)
  x_leaves, x_tree = jax.tree.flatten(x)
  # (x may be types already: the output types of fsdp_scan's `before`)
  x_avals = [v if isinstance(v, jax_core.AbstractValue) else jax.typeof(v)
             for v in x_leaves]
  try:
    closed, out_tree = trace_layer(
        layer, jax.tree.unflatten(x_tree, x_avals), w_avals)
  except Exception as e:  # noqa: BLE001 - re-raised with what fsdp_scan gave it
    raise ValueError(
        f"fsdp_scan(layer=..., params=...): the layer fails on x and one "
        f"layer's weights ({type(e).__name__}: {e}). fsdp_scan reads the "
        f"leading dimension of every leaf of params as the layer dimension "
        f"({n_layers} layers here) and calls {call} with "
        f"x: {_shapes(x)} and params[i]: {_shapes(w_avals)}, gathered "
        f"from the local shards {_shapes(shards)}."
        f"{_gather_hint(transfer)} If params hold one layer's weights, stack "
        "them with a leading layer dimension (e.g. jax.tree.map(lambda a: "
        "a[None], params)).") from e
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

  gaps = [_varying_gap(a, b) for a, b in zip(x_avals, out_avals)]
  widen = gaps if any(gaps) else None
  consts = _compat.jaxpr_consts(closed)
  traced = [k for k, c in enumerate(consts) if isinstance(c, jax_core.Tracer)]
  if not traced:
    return layer, [], widen
  jaxpr = _compat.open_jaxpr(closed)

  def lifted(carry, w):
    x, hoisted = carry
    values = list(consts)
    for k, h in zip(traced, hoisted, strict=True):
      values[k] = h
    out = jax_core.eval_jaxpr(jaxpr, values, *jax.tree.leaves(x),
                             *jax.tree.leaves(w))
    return jax.tree.unflatten(x_tree, out), hoisted
  return lifted, [consts[k] for k in traced], widen


def _varying_gap(x_aval, y_aval) -> tuple:
  """The mesh axes `y_aval` varies over and `x_aval` does not (sorted)."""
  have, out = _compat.varying_axes(x_aval), _compat.varying_axes(y_aval)
  return () if have is None or out is None else tuple(sorted(out - have))


def widen_carry(x, widen):
  """x with each leaf cast to vary over its `widen` axes as well.

  Why: a carry leaf made replicated (an aux-loss accumulator
  `jnp.zeros(())`) that the layer makes varying would change type from one
  layer to the next, which a scan refuses; cast once before the stack, the
  carry keeps one type (test_scalar_accumulator_in_the_carry in
  tests/integration/real_clients_fsdp_test.py)."""
  leaves, tree = jax.tree.flatten(x)
  return jax.tree.unflatten(tree, [vary_over(a, axes) if axes else a
                                   for a, axes in zip(leaves, widen)])



def count_layers(params) -> int:
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
          f"sharded dimension after it.{_module_hint(params, leaf)}")
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(
        "fsdp_scan(params=...): the leading (layer) dimension differs between "
        f"leaves: {sizes}. Stack every parameter over the same layers.")
  n = next(iter(sizes.values()))
  if n < 1:
    raise ValueError("fsdp_scan(params=...) holds 0 layers; it needs at least 1.")
  return n


def _module_hint(params, leaf) -> str:
  """What to do when params is a whole module with non-weight leaves (an
  equinox module's dropout rate, a flag)."""
  equinox = any(c.__module__.split(".")[0] == "equinox"
                for c in type(params).__mro__)
  if equinox or not hasattr(leaf, "shape"):
    return (" params looks like a whole module"
            + (f" (an equinox.Module, {type(params).__name__})" if equinox
               else "")
            + ", with leaves that are not weights: pass its stacked arrays "
            "only, e.g. `params, static = eqx.partition(stacked, "
            "eqx.is_array)`, and rebuild each layer inside `layer` with "
            "`eqx.combine(params_i, static)` (docs/fsdp.md, equinox).")
  return ""


def choose_transfer(axis, params, shard_dims, precision=None, bucket=False,
                    replica_axis=None) -> Transfer:
  axes = _axis_names(axis)
  bound = _compat.bound_axis_names()
  replicas = _replica_axes(replica_axis, axes, bound, params)
  dtypes = [jnp.result_type(p) for p in jax.tree.leaves(params)]
  if bound is not None and all(a in bound for a in axes):
    return ShardMapTransfer(axes if len(axes) > 1 else axes[0],
                            _local_dims(params, shard_dims, axes),
                            precision, dtypes, bucket,
                            None if replicas is None else
                            replicas if len(replicas) > 1 else replicas[0])
  if bound and any(a in bound for a in axes):
    raise NameError(
        f"fsdp_scan(axis={axis!r}): {_in_scope(axes, bound)} Give only axes "
        "the enclosing jax.shard_map binds.")
  layouts = _explicit_layouts(axis, axes, bound, params, shard_dims)
  if _explicit_futures_here():
    return FutureReshardTransfer(axes, layouts, precision, dtypes, bucket)
  _say_explicit_mesh_is_not_prefetched()
  return ReshardTransfer(axes, layouts, precision, dtypes)


def _explicit_futures_here() -> bool:
  """Whether an explicit mesh's moves are futures here
  (explicit_futures.py): for a TPU whose all-gather is a plain async pair
  (v5e) or N-1 permutes (v5p, collectives/permute_forms.py; not a
  generation where `all_gather_start` takes its all-to-all form), with a
  jax that lowers a future as one (0.12). Elsewhere they are reshards:
  tied into their step on GPU (xla/gpu_ties.py), left to XLA with older
  jax (whose plugin cannot take a future), blocking on CPU anyway."""
  platform, _ = _compat.trace_device()
  return (platform == "tpu" and _compat.ASYNC_CUSTOM_CALLS
          and (permute_forms.wanted("all_gather")
               or not tpu_forms.wanted("all_gather")))


def _say_explicit_mesh_is_not_prefetched() -> None:
  """Where the moves stay `jax.reshard`s (not `_explicit_futures_here`) and
  the trace targets TPU, say once that XLA's partitioner schedules them:
  TPU has no ties for them (GPU's, xla/gpu_ties.py, keep them in their
  step), and the TPU compilers overlapped few (docs/compilers.md, the
  explicit-mesh column). CPU and GPU stay silent. Pinned by
  fsdp_explicit_warning_test.py."""
  platform, kind = _compat.trace_device()
  if platform in (None, "cpu", "cuda", "rocm", "gpu"):
    return
  why = (f"jax {jax.__version__} lowers a future as its plain collective, "
         "which a reshard's place cannot hold (jax 0.12 can: there, on v5e "
         "and v5p, the moves are futures and overlap)"
         if not _compat.ASYNC_CUSTOM_CALLS else
         f"{kind or 'this generation'} has no async all-gather pair that "
         "a program can place (v5e and v5p do: there the moves are futures "
         "and overlap)")
  not_async.warn_once("fsdp-explicit-mesh", (
      f"fsdp_scan on an explicit mesh, for {platform}: the weights move by "
      f"jax.reshard, which XLA's partitioner schedules, because {why}; the "
      "TPU compilers overlap few of them (docs/compilers.md). To keep them "
      "in flight, call fsdp_scan inside jax.shard_map over the fsdp axis, "
      "where the moves are all_gather_start / psum_scatter_start futures. "
      "Silence with warnings.filterwarnings('ignore', "
      "category=jax_overlap.CollectiveNotAsyncWarning)."))


def _replica_axes(replica_axis, axes, bound, params):
  """HSDP's replica axes as a tuple, or None; checked against the axes in
  scope (inside shard_map: those it binds; on an explicit mesh: the
  leaves' mesh axes) and against `axis`."""
  if replica_axis is None:
    return None
  replicas = tuple(replica_axis) if isinstance(replica_axis, (tuple, list)) \
      else (replica_axis,)
  if not replicas or not all(isinstance(a, str) for a in replicas) \
      or set(replicas) & set(axes):
    raise TypeError(
        f"fsdp_scan(replica_axis=...) must be a mesh axis name or a tuple of "
        f"names, none of them in axis={axes if len(axes) > 1 else axes[0]!r}, "
        f"got {replica_axis!r}.")
  known = set(bound or ())
  if not bound:
    for p in jax.tree.leaves(params):
      mesh = getattr(getattr(jax.typeof(p), "sharding", None), "mesh", None)
      known |= set(getattr(mesh, "axis_names", ()) or ())
  missing = [a for a in replicas if a not in known]
  if missing:
    where = (f"the enclosing jax.shard_map binds {tuple(sorted(known))}"
             if bound else
             f"the leaves' mesh has axes {tuple(sorted(known))}")
    raise NameError(
        f"fsdp_scan(replica_axis={replica_axis!r}): no mesh axis named "
        f"{missing[0]!r} here: {where}.")
  return replicas


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
  shard_map; None for a leaf kept replicated over `axes`.

  A leaf whose type says it does not vary over `axes` (in_specs left it
  replicated, e.g. `P()`) is never gathered: gathering p copies of it would
  hand the layer a p-times-larger, wrong weight (tests/patterns/fsdp/fsdp_test.py
  test_replicated_leaf_is_never_gathered)."""
  paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(params))
  one_int = isinstance(shard_dims, int) and not isinstance(shard_dims, bool)
  if shard_dims is None or one_int:
    # Default 1, or the one int, for every leaf that varies over `axes`;
    # without vma tracking (check_vma=False) every leaf counts as sharded.
    dims = [1 if shard_dims is None else shard_dims] * len(leaves)
    own = [False] * len(leaves)
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
    dims, own = [], []   # own: the dim was given for that leaf alone
    for d, sub in zip(jax.tree.leaves(shard_dims, is_leaf=is_none), subtrees):
      n = len(jax.tree.leaves(sub))
      dims += [d] * n
      own += [n == 1 and jax.tree.structure(sub).num_nodes == 1] * n
  for path, d, p in zip(paths, dims, leaves):
    if d is not None and (isinstance(d, bool) or not isinstance(d, int)
                          or not 1 <= d < jnp.ndim(p)):
      raise ValueError(
          f"fsdp_scan(shard_dims=...): {d!r} is not a dimension after the "
          f"layer dimension of leaf {jax.tree_util.keystr(path) or '.'}, of "
          f"shape {jnp.shape(p)} (give 1 to {jnp.ndim(p) - 1}, or None for a "
          "leaf kept replicated).")
  # A dim that covers several leaves (one int, a prefix) is for those of them
  # that are sharded; one named for a replicated leaf alone is refused below.
  dims = [None if not mine and _replicated(p, axes) else d
          for d, mine, p in zip(dims, own, leaves)]

  def check(path, d, p):
    if d is None:
      return None
    where = jax.tree_util.keystr(path) or "(params itself)"
    vma = _compat.varying_axes(p)
    over = None if vma is None else vma & set(axes)
    named = axes if len(axes) > 1 else axes[0]
    if over is not None and not over:
      raise ValueError(
          f"fsdp_scan(shard_dims=...) names dimension {d} of leaf {where}, "
          f"but its type says it is replicated over axis={named!r} (in_specs "
          "left it unsharded there): gathering it would hand the layer "
          "copies of it, a wrong weight. Give None for this leaf (it is "
          f"then used as it is), or shard it over {named!r} in in_specs.")
    if over is not None and over != set(axes):
      raise ValueError(
          f"fsdp_scan(axis={named!r}): leaf {where} varies over "
          f"{tuple(sorted(over))} of those axes only (its type varies over "
          f"{tuple(sorted(vma))}): gathering it over all of them would give "
          f"the layer a wrong weight. Shard it over all of {named!r} in "
          "in_specs, or give axis= the axes it is sharded over.")
    return d - 1
  return [check(path, d, p) for path, d, p in zip(paths, dims, leaves,
                                                  strict=True)]


def _replicated(p, axes) -> bool:
  """Whether leaf `p`'s type says it varies over none of `axes`."""
  vma = _compat.varying_axes(p)
  return vma is not None and not vma & set(axes)


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
