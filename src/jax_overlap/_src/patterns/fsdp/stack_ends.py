"""The ends of an `fsdp_scan` stack: what runs before it and after it.

Without them each pass starts and ends exposed: the forward pass's first
gather (layer 0) and the backward pass's first gather (the last layer) have
nothing to compute behind them, and the last reduce-scatter (layer 0's
gradient) is waited for where the stack's backward ends. `fsdp_scan(...,
before=embed, after=head)` runs the user's code in those gaps, inside the
stack's own custom VJP:

  forward:  [gather layer 0 | before(x)]  layers 0 .. n-1  after(y)
  backward: [gather layer n-1 | after's backward]  layers n-1 .. 0
            [reduce-scatter layer 0's gradient | before's backward]

Each bracket is one ordered step (`transfer.step`): the collective starts,
the function runs, the collective is waited for. Whatever the user runs after
`fsdp_scan` returns (the optimizer update) is outside the VJP, so the step
above is what can be fenced; the embedding's backward is the compute that
hides the last reduce-scatter.

`before` and `after` may close over traced values (the embedding table, the
head's weights, the labels, even while they are differentiated): they are
traced once and those values lifted into explicit inputs of the VJP, so their
gradients flow.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core

from jax_overlap._src import _compat
from jax_overlap._src.patterns.fsdp.layer_inputs import differentiable
from jax_overlap._src.patterns.fsdp.transfer_protocol import Transfer
from jax_overlap._src.patterns.varying import eval_with_varying_consts, vary_over


class _Lifted:
  """`fn(x)` traced once on x's types, the traced values it closes over
  lifted out: `call(consts, x)` runs it on given consts."""

  def __init__(self, fn: Callable, x, role: str):
    leaves, self.in_tree = jax.tree.flatten(x)
    out_tree = []

    def flat(*leaves):
      out = fn(jax.tree.unflatten(self.in_tree, leaves))
      out_leaves, tree = jax.tree.flatten(out)
      out_tree.append(tree)
      return out_leaves

    try:
      closed = jax.make_jaxpr(flat)(*leaves)
    except Exception as e:  # noqa: BLE001 - re-raised naming the argument
      raise ValueError(
          f"fsdp_scan({role}=...) fails on {_say_types(_ROLE_ARG[role], x)} "
          f"({type(e).__name__}: {e}). {_ROLE_INPUT[role]}") from e
    self.out_tree = out_tree[0]
    self.out_avals = jax.tree.unflatten(self.out_tree, closed.out_avals)
    self.jaxpr = _compat.open_jaxpr(closed)
    self.consts = _compat.jaxpr_consts(closed)
    self.traced = [k for k, c in enumerate(self.consts)
                   if isinstance(c, jax_core.Tracer)]

  def lifted_consts(self) -> list:
    return [self.consts[k] for k in self.traced]

  def call(self, lifted, x):
    values = list(self.consts)
    for k, c in zip(self.traced, lifted, strict=True):
      values[k] = c
    out = eval_with_varying_consts(self.jaxpr, values, jax.tree.leaves(x))
    return jax.tree.unflatten(self.out_tree, out)


_ROLE_INPUT = {
    "before": "It is called as before(x) on fsdp_scan's x, and returns the "
              "first layer's input.",
    "after": "It is called as after(y) on the last layer's output y (the "
             "same structure, shapes and dtypes as the first layer's input).",
}


_ROLE_ARG = {"before": "x", "after": "y"}


def _say_types(name, tree) -> str:
  def one(v):
    aval = v if isinstance(v, jax_core.AbstractValue) else jax.typeof(v)
    return aval.str_short() if hasattr(aval, "str_short") else str(aval)
  return f"{name}: " + ", ".join(
      f"{jax.tree_util.keystr(k) or '.'} {one(v)}"
      for k, v in jax.tree_util.tree_leaves_with_path(tree))


def check_end(fn, role: str) -> None:
  if fn is not None and not callable(fn):
    raise TypeError(
        f"fsdp_scan({role}=...) must be a function or None, got {fn!r}. "
        f"{_ROLE_INPUT[role]}")


def _vjp(fn, *args):
  """`jax.vjp` with respect to the inexact leaves of `args` only; the
  pullback returns float0 zeros for the others (integer tokens, keys)."""
  leaves, tree = jax.tree.flatten(args)
  moving = [differentiable(a) for a in leaves]

  def on_moving(*ms):
    it = iter(ms)
    full = [next(it) if m else a for a, m in zip(leaves, moving)]
    return fn(*jax.tree.unflatten(tree, full))

  out, pull = jax.vjp(on_moving, *[a for a, m in zip(leaves, moving) if m])
  return out, _Pullback(pull, tree, tuple(moving),
                        tuple(None if m else jnp.shape(a)
                              for a, m in zip(leaves, moving)))


class _Pullback:
  """A pullback over some leaves of a pytree; the rest get float0 zeros
  (made outside any ordered block: constants, no computation)."""

  def __init__(self, pull, tree, moving, shapes):
    self.pull, self.tree, self.moving, self.shapes = pull, tree, moving, shapes

  def __call__(self, ct):
    return self.pull(ct)

  def complete(self, bars):
    it = iter(bars)
    return jax.tree.unflatten(self.tree, [
        next(it) if m else np.zeros(shape, dtype=jax.dtypes.float0)
        for shape, m in zip(self.shapes, self.moving)])


jax.tree_util.register_pytree_node(
    _Pullback, lambda p: ((p.pull,), (p.tree, p.moving, p.shapes)),
    lambda aux, children: _Pullback(children[0], *aux))


class StackEnds:
  """`before` and `after` around one `fsdp_scan`, and the layer's own lifted
  values (`hoisted`, see `traced_layer`) carried beside x.

  The VJP's input is `(x, hoisted, before's consts, after's consts)`; the
  stack's carry is `before(x)` (with `hoisted`: `(before(x), hoisted)`);
  the VJP's output is `after(y)`.
  """

  def __init__(self, before, after, x):
    self.before = _Lifted(before if before is not None else (lambda x: x), x,
                          "before")
    self.stack_input = self.before.out_avals
    self.after = None if after is None else _Lifted(after, self.stack_input,
                                                    "after")
    self.hoisted = False

  def run_input(self, x, hoisted):
    self.hoisted = bool(hoisted)
    typed = {}   # id -> the const typed as varying (one per traced value)
    consts = lambda ends: [] if ends is None else [
        _varying_like_outputs(c, ends.out_avals, typed)
        for c in ends.lifted_consts()]
    run = (x, list(hoisted), consts(self.before), consts(self.after))
    try:   # (a pvary nested in a call inside before/after refuses them)
      jax.eval_shape(lambda run, y: (
          self.before.call(run[2], run[0]),
          self.after and self.after.call(run[3], y)), run, self.stack_input)
    except Exception:  # noqa: BLE001 - the consts as they are then
      return (x, list(hoisted), self.before.lifted_consts(),
              [] if self.after is None else self.after.lifted_consts())
    return run

  # --- forward -----------------------------------------------------------

  def enter_compute(self, x_run, save: bool):
    """`before(x)`: `(carry, saved)` (use_order.py runs it in its own
    ordered block)."""
    x, hoisted, consts, _ = x_run
    if save:
      h, pull = _vjp(lambda x, c: self.before.call(c, x), x, consts)
    else:
      h, pull = self.before.call(consts, x), None
    return ((h, hoisted) if self.hoisted else h), pull

  def enter(self, transfer: Transfer, x_run, first_shards, save: bool):
    """`before(x)` with layer 0's gather in flight. Returns `(carry,
    layer 0's weights, saved)`."""
    (carry, pull), first, _ = transfer.step(
        lambda: self.enter_compute(x_run, save), gather=first_shards)
    return carry, first, pull

  def leave(self, carry, x_run, save: bool):
    """`after(y)` on the last layer's output. Returns `(out, saved)`."""
    y = carry[0] if self.hoisted else carry
    if self.after is None:
      return y, None
    consts = x_run[3]
    if not save:
      return self.after.call(consts, y), None
    return _vjp(lambda y, c: self.after.call(c, y), y, consts)

  # --- backward ----------------------------------------------------------

  def leave_back(self, transfer: Transfer, saved, out_bar, last_shards):
    """after's backward with the last layer's gather in flight. Returns
    `(carry cotangent, the last layer's weights, after's consts' cotangent)`;
    `last_shards` None (weights kept from the forward pass): no gather, and
    the weights come back None."""
    _, pull_after, hoisted = saved
    if pull_after is None:   # no `after`: nothing to hide the gather behind
      y_bar, consts_bar = out_bar, []
      w = None if last_shards is None else transfer.gather_now(last_shards)
    else:
      bars, w, _ = transfer.step(lambda: pull_after(out_bar),
                                 gather=last_shards)
      y_bar, consts_bar = pull_after.complete(bars)
    if self.hoisted:
      y_bar = (y_bar, jax.tree.map(jnp.zeros_like, hoisted))
    return y_bar, w, consts_bar

  def back_compute(self, saved, carry_bar):
    """before's backward on layer 0's x cotangent (use_order.py runs it
    with layer 0's last reduce-scatter in flight)."""
    h_bar = carry_bar[0] if self.hoisted else carry_bar
    return saved[0](h_bar)

  def back_finish(self, saved, after_bar, carry_bar, bars):
    """The VJP input's cotangent from `back_compute`'s result."""
    hoisted_bar = carry_bar[1] if self.hoisted else []
    x_bar, consts_bar = saved[0].complete(bars)
    return (x_bar, list(hoisted_bar), consts_bar, after_bar)

  def enter_back(self, transfer: Transfer, saved, after_bar, carry_bar,
                 g0):
    """before's backward with layer 0's reduce-scatter in flight. Returns
    `(the VJP input's cotangent, layer 0's scattered gradient)`."""
    pull_before = saved[0]
    h_bar, hoisted_bar = carry_bar if self.hoisted else (carry_bar, [])
    if transfer.stages == 2:
      # HSDP: the reduce-scatter hides behind before's backward; the
      # all-reduce over the replicas that follows it is waited for at once.
      bars, _, s0, _ = transfer.step2(lambda: pull_before(h_bar), scatter=g0)
      g0 = transfer.reduce_now(s0)
    else:
      bars, _, g0 = transfer.step(lambda: pull_before(h_bar), scatter=g0)
    x_bar, consts_bar = pull_before.complete(bars)
    return (x_bar, list(hoisted_bar), consts_bar, after_bar), g0


def _varying_like_outputs(c, out_avals, typed: dict):
  """`c` (a value `before` or `after` closes over) typed as varying over
  the mesh axes every output of the function varies over (inside shard_map).

  Why: a replicated value (the embedding table, `P()`) used with per-device
  data is cast to varying inside the function, and the transpose of that
  cast is an all-reduce of its gradient, which would then run inside the
  window of the stack's last reduce-scatter (or the backward's first
  gather), blocking, queued behind it on the link. Cast here, outside the
  stack's VJP, the all-reduce is jax's, after the VJP's backward. The same
  function either way: every path from `c` to an output varying over an
  axis passes through such a cast (the transpose sums their cotangents).
  A value used once in `before` and once in `after` is cast once, so its
  gradient is all-reduced once."""
  if not (hasattr(c, "dtype") and differentiable(c)):
    return c
  if id(c) in typed:
    return typed[id(c)]
  outs = [_compat.varying_axes(a) for a in jax.tree.leaves(out_avals)]
  mine = _compat.varying_axes(c)
  if not outs or mine is None or any(o is None for o in outs):
    typed[id(c)] = c   # no vma tracking (explicit mesh, check_vma=False)
    return c
  typed[id(c)] = vary_over(c, sorted(frozenset.intersection(*outs)))
  return typed[id(c)]


class NoEnds:
  """No `before` nor `after`: the stack's first gather and last
  reduce-scatter are waited for at once (what `StackEnds` replaces)."""

  def enter_compute(self, x, save: bool):
    return x, None

  def enter(self, transfer: Transfer, x, first_shards, save: bool):
    return x, transfer.gather_now(first_shards), None

  def back_compute(self, saved, x_bar):
    return x_bar

  def back_finish(self, saved, after_bar, x_bar, bars):
    return bars

  def leave(self, carry, x_run, save: bool):
    return carry, None

  def leave_back(self, transfer: Transfer, saved, y_bar, last_shards):
    # last_shards None: the forward pass kept the last layer's weights.
    return y_bar, (None if last_shards is None
                   else transfer.gather_now(last_shards)), None

  def enter_back(self, transfer: Transfer, saved, after_bar, x_bar, g0):
    return x_bar, transfer.scatter_now(g0)


NO_ENDS = NoEnds()


def saved_of(ends, enter_saved, leave_saved, x_run) -> Any:
  """What the backward pass needs of the ends: before's and after's
  pullbacks, and the hoisted values (for their zero cotangent's types)."""
  if isinstance(ends, NoEnds):
    return None
  return (enter_saved, leave_saved, x_run[1])
