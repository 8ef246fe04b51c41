"""`fsdp_scan`: a stack of layers whose weight gathers hide behind compute."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap._src import _compat, eager_shard_map
from jax_overlap._src.patterns.fsdp.arguments import (check_remat_policy,
                                                      choose_transfer,
                                                      count_layers,
                                                      gathered_types,
                                                      traced_layer,
                                                      widen_carry)
from jax_overlap._src.patterns.fsdp.layer_outputs import LayerOutputs
from jax_overlap._src.patterns.fsdp.layer_inputs import (PairTransfer,
                                                         check_xs,
                                                         differentiable,
                                                         float0_zeros,
                                                         with_layer_inputs)
from jax_overlap._src.patterns.fsdp import pipelined, use_order
from jax_overlap._src.patterns.fsdp.memory_knobs import (kept_layers,
                                                         prefetch_depth)
from jax_overlap._src.patterns.fsdp.precision import Precision
from jax_overlap._src.patterns.fsdp.stack_ends import (NO_ENDS, StackEnds,
                                                       check_end, saved_of)
from jax_overlap._src.patterns.fsdp.transfer import (ReshardTransfer,
                                                     ShardMapTransfer)
from jax_overlap._src.patterns.fsdp.weight_split import split_by_weights


def fsdp_scan(layer: Callable[[Any, Any], Any], x, params, *, axis,
              shard_dims=None, unroll: int = 2, remat_policy=None,
              xs=None, param_dtype=None, reduce_dtype=None,
              bucket: bool = True, replica_axis=None,
              reshard_after_forward: bool | int = 1, prefetch: int = 1,
              before=None, after=None, has_ys: bool = False):
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
    layer: `layer(x, layer_params) -> x` (`layer(x, layer_params, xs_i)`
      with `xs`), the same structure, shapes and
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
    remat_policy: a `jax.checkpoint` policy (a function such as
      `jax.checkpoint_policies.nothing_saveable`, not its name): the layer
      is recomputed in the backward pass as it says, instead of saving all
      its activations.
    xs: per-layer inputs, a pytree stacked over the layers like `params`
      (PRNG keys for dropout, layer indices, per-layer flags or scales),
      never gathered: layer i is called as `layer(x, params[i], xs[i])`, as
      `lax.scan` passes its `xs`. Values computed from `xs[i]` alone (a
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

  Returns:
    The output of the last layer (with `after`: `after` of it). Its gradients with respect to `params` come
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

    With the embedding run before the stack and the loss after it (their
    backward passes hide the first and last transfers of the step):

    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "d"), P("d")),
    ...                out_specs=P())
    ... def loss(table, ws, tokens):
    ...   return jax.lax.pmean(fsdp_scan(
    ...       layer, tokens, ws, axis="d", before=lambda t: table[t],
    ...       after=lambda y: jnp.mean(y ** 2)), "d")
    >>> table, tokens = jnp.ones((5, 8)), jnp.arange(4) % 5
    >>> [g.shape for g in jax.grad(loss, argnums=(0, 1))(table, ws, tokens)]
    [(5, 8), (3, 8, 8)]
  """
  if eager_shard_map.in_eager_shard_map():
    # An eager shard_map compiles each primitive anew at every call; the whole
    # scan runs there as one cached program (tests/integration/real_clients_eager_test.py).
    settings = {k: v for k, v in locals().items()
                if k not in ("layer", "x", "params")}
    return eager_shard_map.run_as_one(
        lambda x, params: fsdp_scan(layer, x, params, **settings), x, params)
  if not callable(layer):
    raise TypeError(f"fsdp_scan(layer=...) must be a function "
                    f"layer(x, layer_params) -> x, got {layer!r}.")
  if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
    raise ValueError(f"fsdp_scan(unroll=...) must be an int >= 1, got {unroll!r}.")
  check_remat_policy(remat_policy)
  if not isinstance(has_ys, bool):
    raise TypeError(f"fsdp_scan(has_ys=...) must be True or False, got "
                    f"{has_ys!r}.")
  if not isinstance(bucket, bool):
    raise TypeError(f"fsdp_scan(bucket=...) must be True or False, got "
                    f"{bucket!r}.")
  precision = Precision(param_dtype, reduce_dtype)
  check_end(before, "before")
  check_end(after, "after")
  n_layers = count_layers(params)
  kept = kept_layers(reshard_after_forward, n_layers)
  depth = prefetch_depth(prefetch, n_layers)
  if xs is not None:
    check_xs(xs, n_layers)
  ends = None if before is None and after is None else \
      StackEnds(before, after, x)
  if ends is not None and (kept > 1 or depth > 1):
    raise ValueError(
        f"fsdp_scan(before=/after=...) runs with reshard_after_forward True "
        f"or 1 and prefetch=1 only, got reshard_after_forward="
        f"{reshard_after_forward!r} and prefetch={prefetch!r} (which keep "
        f"{kept} layers and gather {depth} ahead). Run before/after around "
        f"the call instead, or use reshard_after_forward=1 (which hides the "
        f"backward pass's first regather as well).")
  x_in, x = x, (x if ends is None else ends.stack_input)
  transfer = choose_transfer(axis, params, shard_dims, precision, bucket,
                             replica_axis)
  if has_ys:
    # Each layer's y rides in the carry, written at its index (layer_outputs.py).
    outputs = LayerOutputs(layer, x, gathered_types(transfer, _layer(params, 0)),
                           xs, n_layers)
    layer, xs = outputs.layer, outputs.xs(xs)
    if ends is None:
      x = (x, outputs.buffer())
    else:
      before, after = outputs.before(before), outputs.after(after)
      ends = StackEnds(before, after, x_in)
      x = ends.stack_input
  if isinstance(transfer, ReshardTransfer):
    trial = layer if xs is None else (
        lambda x, w, xs0=_layer(xs, 0): layer(x, w, xs0))
    transfer.reduced = transfer.reduced_axes(trial, x, _layer(params, 0))
  if xs is not None:
    # Layer i's weights and xs[i] travel as a pair (layer_inputs.py).
    layer, transfer = with_layer_inputs(layer), PairTransfer(transfer)
    params = (params, xs)
  user_layer = layer
  layer, hoisted, widen = traced_layer(user_layer, x, transfer,
                                       _layer(params, 0), n_layers)
  if widen is not None:
    # The layer makes carry leaves vary over more axes: they start so.
    if ends is None:
      x = widen_carry(x, widen)
    else:
      first = before if before is not None else (lambda v: v)
      ends = StackEnds(lambda v: widen_carry(first(v), widen), after, x_in)
      x = ends.stack_input
    layer, hoisted, _ = traced_layer(user_layer, x, transfer,
                                     _layer(params, 0), n_layers)
  if ends is not None:
    return _fsdp_scan(layer, ends.run_input(x_in, hoisted), params, n_layers,
                      transfer, unroll, remat_policy, ends,
                      keep_last=kept == 1)
  schedule = lambda *a: _fsdp_scan(*a, keep_last=kept == 1)
  if kept > 1 or depth > 1:   # more layers keep their weights, or deeper prefetch
    if kept and not isinstance(getattr(transfer, "inner", transfer),
                               ShardMapTransfer):
      unroll = _compat.unroll_saving_reduced(unroll)
    schedule = lambda *a: pipelined.run(*a, kept=kept, prefetch=depth)
  if hoisted:
    # The layer closed over traced values (perhaps being differentiated):
    # they ride along in the carry, so their gradients flow like x's.
    y, _ = schedule(layer, (x, hoisted), params, n_layers, transfer,
                    unroll, remat_policy)
    return y
  return schedule(layer, x, params, n_layers, transfer, unroll, remat_policy)


def _fsdp_scan(layer, x, params, n_layers, transfer, unroll, remat_policy,
               ends=NO_ENDS, keep_last=False):
  x_avals = []   # x's types as one layer sees them (for the backward's trace)
  split = use_order.applies(transfer, n_layers)

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

    x_run = x   # with ends: (x, hoisted, before's and after's consts)
    # Layer 0's gathers split by use order (use_order.py), else one.
    first = None if not split else use_order.forward_first(
        transfer, run_layer, lambda: ends.enter_compute(x_run, save),
        _layer(params, 0), _layer(params, 1))
    if first is None:
      x, w0, entered = ends.enter(transfer, x_run, _layer(params, 0), save)
      saved0, loop_from = None, 1
    else:
      x, saved0, entered, w0 = first
      loop_from = 2
    (x, w_last), saved = _scan_remainder_first(
        body, (x, w0), jnp.arange(loop_from, n_layers), unroll)
    (x, saved_last), _, _ = transfer.step(lambda: run_layer(x, w_last))
    x, left = ends.leave(x, x_run, save)
    # keep_last: the last layer's gathered weights are saved (the backward
    # pass starts with it; reshard_after_forward=1, memory_knobs.py).
    return x, (saved, saved_last, saved_of(ends, entered, left, x_run),
               w_last if keep_last and save else None, saved0)

  @jax.custom_vjp
  def run(x, params):
    return forward(x, params, save=False)[0]

  def run_fwd(x, params):
    y, saved = forward(x, params, save=True)
    return y, (saved, params)

  def run_bwd(residuals, y_bar):
    # `saved` holds the pullbacks of layers 0 .. n-2, `saved_last` layer n-1's.
    (saved, saved_last, ends_saved, w_last, saved0), params = residuals
    # With layer 0 split, `saved` holds layers 1 .. n-2 and saved0 layer 0.
    saved_at = (lambda i: saved0 if isinstance(i, int) and i == 0
                else _layer(saved, i - 1)) if saved0 is not None \
        else (lambda i: _layer(saved, i))
    backward = lambda pullback, w, y_bar: _layer_backward(
        layer, pullback, w, x_avals[0], y_bar)
    # Integer, boolean and key parts of xs have float0 cotangents: a scalar
    # stands in their stack during the loop, float0 zeros come back.
    grads = jax.tree.map(
        lambda p: jnp.zeros_like(p) if differentiable(p) else jnp.zeros(()),
        params)
    put = lambda grads, g, i: jax.tree.map(
        lambda G, g: lax.dynamic_update_index_in_dim(G, g, i, 0)
        if G.ndim else G, grads, g)

    # With keep_last the last layer's weights were saved: nothing to gather.
    y_bar, w, after_bar = ends.leave_back(
        transfer, ends_saved, y_bar,
        None if keep_last else _layer(params, n_layers - 1))
    if keep_last:
      w = w_last
    scatter_first = lambda x_bar, g0: ends.enter_back(
        transfer, ends_saved, after_bar, x_bar, g0)
    if n_layers == 1:
      x_bar, g = backward(saved_last, w, y_bar)
      x_bar, g = scatter_first(x_bar, g)
      grads = put(grads, g, 0)
      return x_bar, jax.tree.map(
          lambda G, p: G if differentiable(p) else float0_zeros(p), grads,
          params)

    finish = lambda grads: jax.tree.map(
        lambda G, p: G if differentiable(p) else float0_zeros(p), grads, params)
    if transfer.stages == 2:
      x_bar, grads = _hsdp_backward(transfer, backward, saved_at, saved_last,
                                    params, w, y_bar, grads, put, n_layers,
                                    unroll, scatter_first)
      return x_bar, finish(grads)

    (x_bar, pending), w, _ = transfer.step(
        lambda: backward(saved_last, w, y_bar),
        gather=_layer(params, n_layers - 2))

    def body(carry, i):   # layer i's backward; prefetch i-1, scatter i+1
      x_bar, w, pending, grads = carry
      (x_bar, g), w_prev, done = transfer.step(
          lambda: backward(saved_at(i), w, x_bar),
          gather=_layer(params, i - 1), scatter=pending)
      return (x_bar, w_prev, g, put(grads, done, i + 1)), None

    if n_layers > 2:   # (with layer 0 split, 2 layers save no stack)
      (x_bar, w, pending, grads), _ = _scan_remainder_first(
          body, (x_bar, w, pending, grads), jnp.arange(n_layers - 2, 0, -1),
          unroll)
    # Layer 0's gradients reduce-scattered as they are finished
    # (use_order.py), else in one reduce-scatter behind before's backward.
    last = None if not split else use_order.backward_first(
        transfer, backward, saved_at(0), w, x_bar, pending,
        lambda x0: ends.back_compute(ends_saved, x0))
    if last is None:
      (x_bar, g0), _, g1 = transfer.step(
          lambda: backward(saved_at(0), w, x_bar), scatter=pending)
      x_bar, g0 = scatter_first(x_bar, g0)
    else:
      (bars, x0), g0, g1 = last
      x_bar = ends.back_finish(ends_saved, after_bar, x0, bars)
    grads = put(put(grads, g1, 1), g0, 0)
    return x_bar, jax.tree.map(
        lambda G, p: G if differentiable(p) else float0_zeros(p), grads, params)

  run.defvjp(run_fwd, run_bwd)
  return run(x, params)


def _hsdp_backward(transfer, backward, saved_at, saved_last, params, w, y_bar,
                   grads, put, n_layers, unroll, scatter_first):
  """The backward pass with a second stage (HSDP): layer i's step prefetches
  layer i-1, reduce-scatters layer i+1's gradient over the fsdp axis and
  all-reduces layer i+2's (reduce-scattered a step before) over the
  replicas. Returns `(x_bar, grads)`."""
  (x_bar, g), w, _, _ = transfer.step2(
      lambda: backward(saved_last, w, y_bar),
      gather=_layer(params, n_layers - 2))
  if n_layers == 2:
    (x_bar, g0), _, s1, _ = transfer.step2(
        lambda: backward(saved_at(0), w, x_bar), scatter=g)
    grads = put(grads, transfer.reduce_now(s1), 1)
    x_bar, g0 = scatter_first(x_bar, g0)
    return x_bar, put(grads, g0, 0)
  # Layer n-2: nothing scattered yet to all-reduce.
  (x_bar, g_next), w, s, _ = transfer.step2(
      lambda: backward(saved_at(n_layers - 2), w, x_bar),
      gather=_layer(params, n_layers - 3), scatter=g)

  def body(carry, i):   # layer i's backward; prefetch i-1, scatter i+1,
    x_bar, w, g, s, grads = carry   # all-reduce i+2
    (x_bar, g_i), w_prev, s_next, done = transfer.step2(
        lambda: backward(saved_at(i), w, x_bar),
        gather=_layer(params, i - 1), scatter=g, reduce=s)
    return (x_bar, w_prev, g_i, s_next, put(grads, done, i + 2)), None

  (x_bar, w, g, s, grads), _ = _scan_remainder_first(
      body, (x_bar, w, g_next, s, grads), jnp.arange(n_layers - 3, 0, -1),
      unroll)
  (x_bar, g0), _, s1, done2 = transfer.step2(
      lambda: backward(saved_at(0), w, x_bar), scatter=g, reduce=s)
  grads = put(put(grads, done2, 2), transfer.reduce_now(s1), 1)
  x_bar, g0 = scatter_first(x_bar, g0)
  return x_bar, put(grads, g0, 0)


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
