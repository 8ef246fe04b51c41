"""`fsdp_scan`: a stack of layers whose weight gathers hide behind compute."""

from __future__ import annotations

from typing import Any, Callable

from jax_overlap._src import eager_shard_map
from jax_overlap._src.patterns import eager_block
from jax_overlap._src.patterns.fsdp import argument_order, engine, use_order
from jax_overlap._src.patterns.fsdp.arguments import (check_remat_policy,
                                                      choose_transfer,
                                                      count_layers,
                                                      gathered_types,
                                                      traced_layer,
                                                      widen_carry)
from jax_overlap._src.patterns.fsdp.layer_inputs import (PairTransfer,
                                                         check_xs,
                                                         with_layer_inputs)
from jax_overlap._src.patterns.fsdp.layer_outputs import LayerOutputs
from jax_overlap._src.patterns.fsdp.one_layer import layer_at
from jax_overlap._src.patterns.fsdp.plan import (check_bool, check_unroll,
                                                 kept_layers, plan,
                                                 prefetch_depth)
from jax_overlap._src.patterns.fsdp.precision import Precision
from jax_overlap._src.patterns.fsdp.stack_ends import StackEnds, check_end


def fsdp_scan(layer: Callable[[Any, Any], Any], x, params, *, axis,
              shard_dims=None, unroll: int | None = None,
              remat_policy=None,
              xs=None, param_dtype=None, reduce_dtype=None,
              bucket: bool = True, replica_axis=None,
              reshard_after_forward: bool | int = 1, prefetch: int = 1,
              before=None, after=None, has_ys: bool = False,
              params_first: bool = False):
  """Applies `layer` once per layer of `params`, prefetching the next weights.

  Fully sharded data parallelism over a scanned stack of layers: each layer's
  weights live sharded over mesh axis `axis`, are gathered just before use,
  and the gather of layer i+1 is in flight while layer i computes (double
  buffering). In the backward pass the gather of layer i-1 and the
  reduce-scatter of layer i+1's weight gradient are in flight while layer i's
  backward computes. Every step is fenced with `program_order`, so XLA cannot
  undo the overlap. Gathered weights are not saved for the backward pass
  (nor values computed from them alone, such as a cast): the residuals are
  activations only, and the backward pass gathers the weights again, except
  for the last layers `reshard_after_forward` keeps (by default the last
  one, which the backward pass runs first).

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
    the fsdp axes is used as it is. For TPU v5e with jax 0.12 the moves
    are futures started and finished in `jax.shard_map`s over the fsdp
    axes around the layer, which still computes on global arrays
    (explicit_futures.py): there the prefetch overlaps as inside shard_map.

  Args:
    layer: `layer(layer_params, x) -> x` with `params_first=True`
      (`layer(layer_params, x, xs_i)` with `xs`), the same structure, shapes
      and dtypes out as x's (checked at the call). It may be a `jax.jit`-wrapped
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
      `params` (counting the layer dimension): one int for all sharded
      leaves, or a pytree of ints like `params` (or a prefix of it), with
      None for a leaf kept replicated: used as is, never gathered, its
      gradient reduced over the axis by autodiff as for any replicated
      shard_map input (not twice). Default: 1, the first dimension after the
      layer dimension. A leaf whose type says it does not vary over `axis`
      (in_specs left it replicated, e.g. `P()`) is always kept replicated
      (a dimension named for it alone is an error); without vma tracking
      (`shard_map(..., check_vma=False)`) that cannot be seen, so say None
      there. On an explicit-sharding mesh a leaf whose sharding does not
      mention `axis` is kept replicated the same way.
    unroll: how many layers each iteration of the underlying `lax.scan` runs
      (with `prefetch` p > 1, rounded up to a multiple of p; 1 stays 1).
      None (the default): 1, or p with `prefetch` p > 1. Each more puts one
      more copy of the layer in the compiled program, which the compiler
      then takes longer over (docs/real-clients.md).
    remat_policy: a `jax.checkpoint` policy (a function such as
      `jax.checkpoint_policies.nothing_saveable`, not its name): the layer
      is recomputed in the backward pass as it says, instead of saving all
      its activations.
    xs: per-layer inputs, a pytree stacked over the layers like `params`
      (PRNG keys for dropout, layer indices, per-layer flags or scales),
      never gathered: layer i is called as `layer(params[i], x, xs[i])`
      (the parameters, the carried activation, then the rest, as `lax.scan`
      passes its `xs` after the carry). Values computed from `xs[i]` alone (a
      dropout mask from a key) are recomputed in the backward pass, not
      saved. Float parts get gradients; integer, boolean and key parts
      float0 ones. Inside shard_map give them in_specs `P()` (the same on
      every device) or sharded like x (e.g. per-device keys).
    param_dtype: the dtype each floating shard is cast to before it is
      gathered (PyTorch FSDP2's `MixedPrecisionPolicy(param_dtype=...)`):
      a float32 master copy gathered as `jnp.bfloat16` moves half the bytes,
      and the layer computes with bfloat16 weights. None: the params' own
      dtypes, no cast.
    reduce_dtype: the dtype each floating weight gradient is cast to before
      it is reduce-scattered (FSDP2's `reduce_dtype`; Megatron's
      `grad_reduce_in_fp32` is `jnp.float32`). None: the gradient's own
      dtype, which is `param_dtype` where that is given. Either way the
      gradients come back in each param's own dtype.
    bucket: inside shard_map, gather all of one layer's sharded leaves of
      one dtype in one collective, and reduce-scatter their gradients in
      one, instead of one per leaf (each collective pays a fixed latency;
      packing costs a copy of the shards). False: one per leaf. On an
      explicit-sharding mesh XLA's partitioner makes the collectives and
      this has no effect, except for TPU v5e with jax 0.12, where the moves
      are futures and the reduce-scatters are bucketed.
    replica_axis: hybrid sharding (HSDP): the mesh axis (or tuple of axes)
      the params are replicated over, beside `axis` that they are sharded
      over. Inside shard_map each gathered weight is typed as varying over
      it (else jax would sum its gradient over the replicas itself, and the
      all-reduce below would double it), and each layer's gradient is
      reduce-scattered over `axis`, then all-reduced over `replica_axis`
      one layer later, in flight across the next layer's backward (never a
      whole layer's gradient all-reduced). On an explicit-sharding mesh the
      axis is checked and XLA's partitioner makes that all-reduce (shard
      the batch over both axes).
    reshard_after_forward: how many of the last layers keep their gathered
      weights from the forward pass for the backward pass (PyTorch FSDP2's
      name). The backward pass runs them first, so it would otherwise start
      by waiting for their regathers. `1` (the default): the last layer,
      which hides the backward pass's first regather at no cost in compiled
      temp bytes on H100 (measured: docs/fsdp.md has the table; a one-layer
      stack then gathers once, in the forward pass); True: none, every
      layer is regathered (the least memory, FSDP2's default for non-root
      modules); False: all of them, no regather; an int k: the last k.
    prefetch: how many layers ahead of its use each gather starts (1: the
      next layer's gather runs behind this layer's compute). Each more holds
      one more gathered layer; each gather is still in flight across one
      layer's compute.

    before: a function run before the stack, `before(x)` -> the first
      layer's input (the embedding), while layer 0's gather is in flight;
      in the backward pass its backward runs while layer 0's gradient is
      reduce-scattered (the last reduce-scatter, which has nothing else to
      hide behind). It may close over traced values (the embedding table):
      their gradients flow.
    after: a function run after the stack, `after(y)` on the last layer's
      output (the head, the loss); in the backward pass its backward runs
      while the last layer's weights are gathered again. fsdp_scan then
      returns `after(y)`. See `stack_ends.py` for the schedule.
    has_ys: the layer returns `(x, y)`, as a `lax.scan` body returns
      `(carry, y)`, and fsdp_scan returns `(x, ys)` (with `after`:
      `(after(x), ys)`), the ys stacked over the layers (aux losses, KV
      caches, sown values); their gradients flow. False: the layer returns x.
    params_first: True: the layer is called `layer(params[i], x)`, the
      parameters first, as every pattern calls its function
      (`pipeline_loss`'s `stage_fn(params, x)`, `expert_parallel`'s
      `expert_fn(params, tokens)`, flax's `apply(params, x)`). False (the
      default for now, deprecated): `layer(x, params[i])`, with a
      `jax_overlap.errors.LayerArgumentOrderWarning` at the call; the
      default becomes True in a later release. Types cannot tell the two
      orders apart (a square weight and an activation of one shape fit
      both), so the order is said, not guessed.

  The steps these settings run (what each gathers, computes,
  reduce-scatters and keeps) are `jax_overlap.fsdp_plan(n_layers, ...)`'s,
  run by one executor (patterns/fsdp/plan.py, engine.py).

  Returns:
    The output of the last layer (with `after`: `after` of it). Its gradients with respect to `params` come
    back sharded exactly like `params`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jax_overlap import fsdp_scan
    >>> mesh = jax.make_mesh((2,), ("d",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def layer(w, x):             # one layer's weights, then x
    ...   return jnp.tanh(x @ w)
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(None, "d")),
    ...                out_specs=P("d"))
    ... def model(x, ws):            # ws: this device's shard of each layer
    ...   return fsdp_scan(layer, x, ws, axis="d", params_first=True)
    >>> x, ws = jnp.ones((4, 8)), jnp.full((3, 8, 8), 0.1)   # 3 layers
    >>> model(x, ws).shape
    (4, 8)

    With the embedding run before the stack and the loss after it (their
    backward passes hide the first and last transfers of the step):

    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "d"), P("d")),
    ...                out_specs=P())
    ... def loss(table, ws, tokens):
    ...   return jax.lax.pmean(fsdp_scan(
    ...       layer, tokens, ws, axis="d", before=lambda t: table[t],
    ...       after=lambda y: jnp.mean(y ** 2), params_first=True), "d")
    >>> table, tokens = jnp.ones((5, 8)), jnp.arange(4) % 5
    >>> [g.shape for g in jax.grad(loss, argnums=(0, 1))(table, ws, tokens)]
    [(5, 8), (3, 8, 8)]
  """
  check_bool(params_first, "params_first")
  if not callable(layer):
    raise TypeError(f"fsdp_scan(layer=...) must be a function "
                    f"{argument_order.layer_call(params_first)} -> x, got "
                    f"{layer!r}.")
  if not params_first:   # (said at the user's call, once a call site)
    argument_order.warn_params_last(stacklevel=2)
  if eager_shard_map.in_eager_shard_map():
    # An eager shard_map compiles each primitive anew at every call; the whole
    # scan runs there as one cached program (tests/integration/real_clients_eager_test.py).
    settings = {k: v for k, v in locals().items()
                if k not in ("layer", "x", "params", "params_first")}
    inner = layer if params_first else (
        lambda w, x, *rest: layer(x, w, *rest))
    return eager_block.run_as_one(
        lambda x, params: fsdp_scan(inner, x, params, params_first=True,
                                    **settings), x, params)
  call = argument_order.layer_call(params_first, xs is not None)
  if params_first:   # the executor calls layer(x, w[, xs_i])
    layer = argument_order.x_first(layer)
  check_unroll(unroll)
  check_remat_policy(remat_policy)
  check_bool(has_ys, "has_ys")
  check_bool(bucket, "bucket")
  precision = Precision(param_dtype, reduce_dtype)
  check_end(before, "before")
  check_end(after, "after")
  n_layers = count_layers(params)
  kept_layers(reshard_after_forward, n_layers)   # (checked before the mesh)
  prefetch_depth(prefetch, n_layers)
  if xs is not None:
    check_xs(xs, n_layers)
  transfer = choose_transfer(axis, params, shard_dims, precision, bucket,
                             replica_axis)
  steps = plan(n_layers, prefetch=prefetch,
               reshard_after_forward=reshard_after_forward, unroll=unroll,
               futures=transfer.in_shard_map,
               moves=not transfer.in_shard_map or transfer.moves(),
               hsdp=replica_axis is not None,
               bucket=bucket, before=before is not None,
               after=after is not None, has_ys=has_ys,
               split=use_order.split_wanted())
  ends = None if before is None and after is None else \
      StackEnds(before, after, x)
  x_in, x = x, (x if ends is None else ends.stack_input)
  if has_ys:
    # Each layer's y rides in the carry, written at its index (layer_outputs.py).
    outputs = LayerOutputs(layer, x, gathered_types(transfer, layer_at(params, 0)),
                           xs, n_layers)
    layer, xs = outputs.layer, outputs.xs(xs)
    if ends is None:
      x = (x, outputs.buffer())
    else:
      before, after = outputs.before(before), outputs.after(after)
      ends = StackEnds(before, after, x_in)
      x = ends.stack_input
  # The transfer fitted to the layer (on an explicit mesh: how each leaf is
  # gathered so that the layer's gradient accepts it, transfer.py).
  trial = layer if xs is None else (
      lambda x, w, xs0=layer_at(xs, 0): layer(x, w, xs0))
  transfer = transfer.for_layer(trial, x, layer_at(params, 0))
  if xs is not None:
    # Layer i's weights and xs[i] travel as a pair (layer_inputs.py).
    layer, transfer = with_layer_inputs(layer), PairTransfer(transfer)
    params = (params, xs)
  user_layer = layer
  layer, hoisted, widen = traced_layer(user_layer, x, transfer,
                                       layer_at(params, 0), n_layers, call)
  if widen is not None:
    # The layer makes carry leaves vary over more axes: they start so.
    if ends is None:
      x = widen_carry(x, widen)
    else:
      first = before if before is not None else (lambda v: v)
      ends = StackEnds(lambda v: widen_carry(first(v), widen), after, x_in)
      x = ends.stack_input
    layer, hoisted, _ = traced_layer(user_layer, x, transfer,
                                     layer_at(params, 0), n_layers, call)
  if ends is not None:
    return engine.run(steps, layer, ends.run_input(x_in, hoisted), params,
                      transfer, remat_policy, ends)
  if hoisted:
    # The layer closed over traced values (perhaps being differentiated):
    # they ride along in the carry, so their gradients flow like x's.
    y, _ = engine.run(steps, layer, (x, hoisted), params, transfer,
                      remat_policy)
    return y
  return engine.run(steps, layer, x, params, transfer, remat_policy)
