"""`fsdp_scan`'s schedule when layers keep their gathered weights
(`reshard_after_forward=False` or an int) or gathers start more than one
layer ahead (`prefetch > 1`).

The default schedule (scan.py) gathers layer i+1 behind layer i in both
passes and regathers every layer in the backward pass. Here the schedule is
written out step by step, one step a layer:

* forward: layer 0 is gathered before the first step; step 0 starts the
  gathers of layers 1..p (p = prefetch), step j >= 1 that of layer j+p. A
  gathered layer waits in a buffer of at most p layers until its step.
* the last k layers (k from `reshard_after_forward`) save their gathered
  weights beside their activations.
* backward: the kept layers use the saved weights; the others are
  regathered, each p steps ahead of its use (the ones that cannot be, at
  the first backward step or before it). Step i also reduce-scatters layer
  i+1's gradient (HSDP: and all-reduces layer i+2's over the replicas), as
  in the default schedule.

Each gather is in flight across exactly one step's compute (a future cannot
cross a `lax.scan` iteration, so a gather cannot span two layers inside
the loop): a deeper prefetch moves the gathers earlier and holds more
gathered layers; it does not give a gather more compute to hide behind.

Consecutive steps that do the same thing (the same gathers relative to the
layer, buffer length, weights source, pending reduce-scatters) run as one
`lax.scan`; the others run one by one.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.fsdp.layer_inputs import (differentiable,
                                                         float0_zeros)


def forward_gathers(j: int, n: int, p: int) -> list[int]:
  """The layers whose gathers run during forward step j."""
  if j == 0:
    return list(range(1, min(p, n - 1) + 1))
  return [j + p] if j + p <= n - 1 else []


def backward_gathers(i: int, n: int, p: int, kept: int) -> list[int]:
  """The layers whose regathers run during backward step i (layer i's
  backward), in the order they are used. Layers >= n - kept are not
  regathered; layer n-1, when regathered, is gathered before the first
  step."""
  regathered = n - kept
  if i == n - 1:
    return [r for r in range(min(regathered, n - 1) - 1, -1, -1)
            if r + p >= n - 1]
  r = i - p
  return [r] if 0 <= r < regathered else []


def _backward_buffered(i: int, n: int, p: int, kept: int) -> int:
  """How many regathered layers wait, gathered, at the start of step i."""
  def gathered_at(r):   # the step whose compute r's regather runs behind
    return n if r == n - 1 else min(r + p, n - 1)
  return sum(1 for r in range(n - kept) if r <= i and gathered_at(r) > i)


def loop_unroll(unroll: int, p: int) -> int:
  """The loops' unroll: `unroll` rounded up to a multiple of the prefetch
  depth `p` (unroll=1 stays 1). Each step shifts the carried buffer of
  gathered layers by one; over a multiple of p steps each buffered layer
  ends the iteration in the slot it started in, else XLA copies every
  buffered layer at each iteration's end (prefetch=3 on 12 layers held 1.5
  more gathered layers so on the H100 compiler)."""
  return unroll if unroll == 1 else -(-unroll // p) * p


def _runs(steps, signature):
  """Consecutive steps with equal `signature(step)`, as lists."""
  return [list(g) for _, g in itertools.groupby(steps, key=signature)]


def run(layer, x, params, n_layers, transfer, unroll, remat_policy, *,
        kept: int, prefetch: int):
  """`fsdp_scan`'s result under this schedule (with its custom gradient)."""
  # scan.py holds one layer's forward and backward and the loop helper.
  from jax_overlap._src.patterns.fsdp import scan as _scan  # noqa: PLC0415

  n, p = n_layers, prefetch
  unroll = loop_unroll(unroll, p)
  layer_at, loop = _scan._layer, _scan._scan_remainder_first
  x_avals = []   # x's types as one layer sees them (for the backward's trace)

  def step(compute, stack, gathers, scatter=None, reduce=None):
    """`compute()` with the gathers of the layers `gathers` of `stack` (and the
    reduce-scatter / all-reduce) in flight. Returns (out, gathered list,
    scattered, reduced). Several gathers: nested ordered steps.

    The step's inputs are fenced together before its first operation, so
    its gathers start at this step, not before: these steps are often not
    in a loop (a run of one step, a loop of one trip), and there XLA's
    scheduler started the gathers steps early, each holding a gathered
    layer meanwhile (the transfer's step fences its outputs itself)."""
    shards = [layer_at(stack, g) for g in gathers]
    fenced = program_order(enforce=True, strict_in_out=(True, False))(
        lambda: _nested_steps(compute, shards, scatter, reduce))
    return fenced()

  def _nested_steps(compute, shards, scatter=None, reduce=None):
    if len(shards) > 1:
      def inner():
        out, more, _, _ = _nested_steps(compute, shards[1:])
        return out, more
    else:
      inner = lambda: (compute(), [])
    first = shards[0] if shards else None
    if transfer.stages == 2 and (scatter is not None or reduce is not None):
      (out, more), got, scattered, reduced = transfer.step2(
          inner, gather=first, scatter=scatter, reduce=reduce)
    else:
      (out, more), got, scattered = transfer.step(inner, gather=first,
                                                  scatter=scatter)
      reduced = None
    return out, ([got] if shards else []) + more, scattered, reduced

  # --- forward ---------------------------------------------------------------------

  def forward(x, params_, save: bool):
    def run_layer(x, w):
      if not save:
        return layer(x, w), None
      x_avals[:] = [jax.tree.map(jax.typeof, x)]
      return _scan._layer_forward(layer, remat_policy, x, w)

    def signature(j):
      offsets = tuple(g - j for g in forward_gathers(j, n, p))
      buffered = 1 if j == 0 else min(p, n - j)
      return offsets, buffered, save and j >= n - kept

    def body_of(offsets, keep):
      def body(carry, j):
        x, buf = carry
        (x, saved), got, _, _ = step(lambda: run_layer(x, buf[0]), params_,
                                     [j + o for o in offsets])
        return (x, tuple(buf[1:]) + tuple(got)), (saved, buf[0] if keep
                                                  else None)
      return body

    carry = (x, (transfer.gather_now(layer_at(params_, 0)),))
    pieces = []
    for steps in _runs(range(n), signature):
      offsets, _, keep = signature(steps[0])
      body = body_of(offsets, keep)
      if len(steps) == 1:
        carry, ys = body(carry, steps[0])
        ys = jax.tree.map(lambda a: a[None], ys)
      else:
        carry, ys = loop(body, carry, jnp.arange(steps[0], steps[-1] + 1),
                         unroll)
      pieces.append((steps[0], steps[-1] + 1, ys))
    return carry[0], pieces

  @jax.custom_vjp
  def run_(x, params_):
    return forward(x, params_, save=False)[0]

  def run_fwd(x, params_):
    y, pieces = forward(x, params_, save=True)
    return y, (pieces, params_)

  # --- backward --------------------------------------------------------------------

  def run_bwd(residuals, y_bar):
    pieces, params_ = residuals
    # The backward pass reads the stack through a barrier: else a regather
    # can be the very op of a forward gather (same layer, same operand) and
    # XLA merges the two starts, which have two dones (the H100 compiler's
    # verifier refused 6 layers with prefetch=3 so).
    params_ = lax.optimization_barrier(params_)
    backward = lambda pullback, w, y_bar: _scan._layer_backward(
        layer, pullback, w, x_avals[0], y_bar)
    grads = jax.tree.map(
        lambda p_: jnp.zeros_like(p_) if differentiable(p_) else jnp.zeros(()),
        params_)
    put = lambda grads, g, i: jax.tree.map(
        lambda G, g: lax.dynamic_update_index_in_dim(G, g, i, 0)
        if G.ndim else G, grads, g)
    piece_of = lambda i: next(k for k, (lo, hi, _) in enumerate(pieces)
                              if lo <= i < hi)
    regathered = n - kept
    stages = transfer.stages

    def signature(i):
      offsets = tuple(r - i for r in backward_gathers(i, n, p, kept))
      pending = (i < n - 1) + (stages == 2 and i < n - 2)
      return (offsets, _backward_buffered(i, n, p, kept), i >= regathered,
              pending, piece_of(i))

    def body_of(offsets, from_saved, pending, piece):
      lo, _, (saved_stack, kept_stack) = pieces[piece]

      def body(carry, i):
        x_bar, buf, pend, grads = carry
        saved = layer_at(saved_stack, i - lo)
        if from_saved:
          w = layer_at(kept_stack, i - lo)
        else:
          w, buf = buf[0], tuple(buf[1:])
        scatter = pend[0] if pending >= 1 else None
        reduce = pend[1] if pending >= 2 else None
        (x_bar, g), got, scattered, reduced = step(
            lambda: backward(saved, w, x_bar), params_,
            [i + o for o in offsets],
            scatter=scatter, reduce=reduce)
        if stages == 2:
          # scattered: layer i+1's shard, all-reduced at the next step;
          # reduced: layer i+2's final gradient.
          if reduced is not None:
            grads = put(grads, reduced, i + 2)
          pend = (g,) + ((scattered,) if scattered is not None else ())
        else:
          if scattered is not None:
            grads = put(grads, scattered, i + 1)
          pend = (g,)
        return (x_bar, buf + tuple(got), pend, grads), None
      return body

    buf = (transfer.gather_now(layer_at(params_, n - 1)),) \
        if regathered == n else ()
    carry = (y_bar, buf, (), grads)
    for steps in _runs(range(n - 1, -1, -1), signature):
      offsets, _, from_saved, pending, piece = signature(steps[0])
      body = body_of(offsets, from_saved, pending, piece)
      if len(steps) == 1:
        carry, _ = body(carry, steps[0])
      else:
        carry, _ = loop(body, carry, jnp.arange(steps[0], steps[-1] - 1, -1),
                        unroll)
    x_bar, _, pend, grads = carry
    if stages == 2 and len(pend) == 2:
      grads = put(grads, transfer.reduce_now(pend[1]), 1)
    grads = put(grads, transfer.scatter_now(pend[0]), 0)
    return x_bar, jax.tree.map(
        lambda G, p_: G if differentiable(p_) else float0_zeros(p_), grads,
        params_)

  run_.defvjp(run_fwd, run_bwd)
  return run_(x, params)
