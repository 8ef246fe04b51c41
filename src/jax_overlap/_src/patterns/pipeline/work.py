"""What one device computes for one action of a plan: a forward (F), a
backward (B), its input half (I) or its weight half (W).

An action's variant (the first stage embeds and writes `xs`' cotangent, the
last computes the loss, an idle device writes nothing) is given by flags that
are either Python bools, where the executor picks the variant per device with
a switch, or traced bools, where every device runs the same program
(`lockstep`, executor.py) and the flags mask what it writes. With traced
flags a piece that holds a collective runs on every device and is masked; a
piece without one runs under `lax.cond` (an idle device skips it). Pinned by
tests/patterns/pipeline/pipeline_loss_test.py and pipeline_compose_test.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.patterns.pipeline import residuals as _residuals
from jax_overlap._src.patterns.pipeline import row_writes as _row_writes
from jax_overlap._src.patterns.pipeline.actions import B, F, I, W


@dataclasses.dataclass(frozen=True)
class Model:
  """The user's functions with their closed-over values made explicit.

  `stage(chunk_params, consts, x, i)`, `embed(consts, raw_x)` (None: the
  microbatch is the first stage's input) and `loss(consts, y, target) ->
  (scalar, aux)`; `collective` names the pieces ("stage", "embed", "loss")
  that hold a collective."""
  stage: Callable
  embed: Callable | None
  loss: Callable
  collective: frozenset


def is_float(a) -> bool:
  return jnp.issubdtype(jnp.asarray(a).dtype if not hasattr(a, "dtype")
                        else a.dtype, jnp.inexact)


def float_leaves(tree) -> list:
  return [a for a in jax.tree.leaves(tree) if is_float(a)]


def with_floats(tree, floats, fill):
  """`tree` with its float leaves replaced by `floats`, in order, and the
  others by `fill(leaf)`."""
  it = iter(floats)
  return jax.tree.map(lambda a: next(it) if is_float(a) else fill(a), tree)


def float0_like(a):
  return np.zeros(jnp.shape(a), jax.dtypes.float0)


def _where(flag, a, b):
  if flag is True:
    return a
  if flag is False:
    return b
  return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def _both(a, b):
  if a is True:
    return b
  if a is False or b is False:
    return False
  return a if b is True else jnp.logical_and(a, b)


def _maybe(flag, has_collective: bool, fn, zeros, vary):
  """fn() where `flag`, else `zeros` (a function giving fn's zero output)."""
  if flag is True:
    return fn()
  if flag is False:
    return zeros()
  if has_collective:
    return _where(flag, fn(), zeros())
  return jax.lax.cond(flag, lambda: jax.tree.map(vary, fn()),
                      lambda: jax.tree.map(vary, zeros()))


def _at(a, i):
  return jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _put(a, v, i, on=True):
  v = v.astype(a.dtype)
  if on is not True:
    v = jnp.where(on, v, _at(a, i))
  out = jax.lax.dynamic_update_index_in_dim(a, v, i, 0)
  _row_writes.note(out, a, v, i)   # a switch tick writes it after its branches
  return out


def _add_at(a, v, i, on=True):
  v = v.astype(a.dtype)
  return _put(a, _at(a, i) + (v if on is True else jnp.where(on, v, 0)), i)


def _accumulate(acc, add, on=True):
  return [a + (d.astype(a.dtype) if on is True else jnp.where(on, d, 0).astype(a.dtype))
          for a, d in zip(acc, add)]


@dataclasses.dataclass(frozen=True)
class Work:
  """Builds the action functions for one executor run."""
  model: Model
  m: int
  with_grads: bool
  vary: Callable
  zero_act: Any      # the activation pytree, zeros
  residuals: Any = None   # residuals.Layout: kept from F to B; None: recomputed

  def action(self, kind: str, first, last, active):
    """`(state, params, consts, xs, targets, i, j, s) -> (state, sent
    forward, sent back)` for `kind` with these flags."""
    if kind == F:
      return lambda ops: self._forward(ops, first, last, active)
    return lambda ops: self._backward(ops, first, active, inputs=kind in (B, I),
                                      weights=kind in (B, W))

  def idle(self, ops):
    return self.out(ops[0])

  def out(self, state, fwd=None, bwd=None):
    """(state, sent forward, sent back) as every action returns them: each
    varying like the activations, zeros where `fwd` or `bwd` is None."""
    v = lambda t: jax.tree.map(self.vary, t)
    zero_back = float_leaves(self.zero_act)
    return (v(state), v(self.zero_act if fwd is None else fwd),
            v(zero_back if bwd is None else bwd))

  def _embed(self, consts, raw):
    return raw if self.model.embed is None else self.model.embed(consts, raw)

  def _forward(self, ops, first, last, active):
    state, params, consts, xs, targets, i, j, s = ops
    state = dict(state)
    model, m = self.model, self.m
    stored = jax.tree.map(lambda a: _at(a, s), state["inputs"])
    raw = jax.tree.map(lambda a: _at(a, i), xs)
    x = stored if first is False else _maybe(
        first, "embed" in model.collective,
        lambda: self._embed(consts, raw), lambda: stored, self.vary)
    x = jax.tree.map(lambda a, b: a.astype(b.dtype), x, stored)
    if first is not False:
      state["inputs"] = jax.tree.map(lambda a, v: _put(a, v, s, _both(first, active)),
                                     state["inputs"], x)
    chunk = jax.tree.map(lambda a: _at(a, j), params)
    if self.with_grads and self.residuals is not None:
      inputs = self._stage_inputs(chunk, consts, x)
      y, vjp = _residuals.stage_vjp(self._stage_at(i), self.residuals.recompute,
                                    *inputs)
      kept = self.residuals.split(vjp, inputs)
      state["res"] = [_put(a, self.vary(v), s, active)
                      for a, v in zip(state["res"], kept)]
    else:
      y = model.stage(chunk, consts, x, i)
    if last is False:
      return self.out(state, fwd=y)
    target = jax.tree.map(lambda a: _at(a, i), targets)
    on = _both(last, active)
    loss_out = lambda: self._loss(consts, y, target)
    zeros = lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_out))
    l, aux, dy, dconsts, dtarget = _maybe(on, "loss" in model.collective,
                                          loss_out, zeros, self.vary)
    (state["loss"],) = _accumulate([state["loss"]], [l], on)
    state["aux"] = jax.tree.map(lambda a, v: _put(a, v, i, on), state["aux"], aux)
    if self.with_grads:
      state["dys"] = [_put(a, d / m, s, on) for a, d in zip(state["dys"], dy)]
      state["dconsts"] = _accumulate(state["dconsts"], [d / m for d in dconsts], on)
      state["dtargets"] = [_add_at(a, d / m, i, on)
                           for a, d in zip(state["dtargets"], dtarget)]
    return self.out(state, fwd=y)

  def _loss(self, consts, y, target):
    """(loss, aux, float parts of d loss / d y, of d / d consts, of d / d
    target); the gradients empty when not differentiating."""
    if not self.with_grads:
      l, aux = self.model.loss(consts, y, target)
      return l, aux, [], [], []
    l, vjp, aux = jax.vjp(self.model.loss, consts, y, target, has_aux=True)
    dc, dy, dt = vjp(jnp.ones_like(l))
    return l, aux, float_leaves(dy), float_leaves(dc), float_leaves(dt)

  def _backward(self, ops, first, active, *, inputs, weights):
    state, params, consts, xs, targets, i, j, s = ops
    state = dict(state)
    model = self.model
    x = jax.tree.map(lambda a: _at(a, s), state["inputs"])
    dy = with_floats(x, [_at(a, s) for a in state["dys"]], float0_like)
    dy = jax.tree.map(lambda d, a: d if d.dtype == jax.dtypes.float0
                      else d.astype(a.dtype), dy, x)
    chunk = jax.tree.map(lambda a: _at(a, j), params)
    chunk, cvar, x = self._stage_inputs(chunk, consts, x)
    fn = self._stage_at(i)
    if self.residuals is not None:   # the vjp the forward action kept
      again = lambda: _residuals.stage_vjp(fn, self.residuals.recompute,
                                           chunk, cvar, x)[1]
      vjp = self.residuals.join([_at(a, s) for a in state["res"]],
                                (chunk, cvar, x), again)
      dw, dc, dx = vjp(dy)
      dw, dc, dx = (dw if weights else None, dc if inputs else None,
                    dx if inputs else None)
    elif inputs and weights:
      _, vjp = jax.vjp(fn, chunk, cvar, x)
      dw, dc, dx = vjp(dy)
    elif inputs:
      _, vjp = jax.vjp(lambda c, x_: fn(chunk, c, x_), cvar, x)
      dc, dx = vjp(dy)
      dw = None
    else:
      _, vjp = jax.vjp(lambda w: fn(w, cvar, x), chunk)
      (dw,) = vjp(dy)
      dc = dx = None
    if dw is not None:
      state["grads"] = [_add_at(g, d, j, active)
                        for g, d in zip(state["grads"], float_leaves(dw))]
    if dc is not None:
      state["dconsts"] = _accumulate(state["dconsts"], float_leaves(dc), active)
    if dx is None:
      return self.out(state)
    dx_floats = float_leaves(dx)
    if first is not False:
      on = _both(first, active)
      raw = jax.tree.map(lambda a: _at(a, i), xs)
      back = lambda: self._embed_backward(consts, raw, dx)
      zeros = lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(back))
      dxs_i, dc_embed = _maybe(on, "embed" in model.collective, back, zeros,
                               self.vary)
      state["dxs"] = [_put(a, d, i, on) for a, d in zip(state["dxs"], dxs_i)]
      state["dconsts"] = _accumulate(state["dconsts"], dc_embed, on)
    return self.out(state, bwd=None if first is True else dx_floats)

  def _stage_at(self, i):
    return lambda w, c, x: self.model.stage(w, c, x, i)

  def _stage_inputs(self, chunk, consts, x):
    """(chunk, consts, x) as the stage's vjp takes them: the floats cast to
    vary like the activations, so that jax's vjp keeps each device's part
    instead of summing it over the axes the parameters are replicated over
    (reduce_like sums once, at the end)."""
    cast = lambda t: jax.tree.map(lambda a: self.vary(a) if is_float(a) else a, t)
    return cast(chunk), cast(consts), jax.tree.map(self.vary, x)

  def _embed_backward(self, consts, raw, dx):
    """(float parts of d / d raw, of d / d consts) through the embedding."""
    if self.model.embed is None:
      return float_leaves(dx), [jnp.zeros_like(c) for c in float_leaves(consts)]
    cvar = jax.tree.map(lambda a: self.vary(a) if is_float(a) else a, consts)
    _, vjp = jax.vjp(self.model.embed, cvar, raw)
    dc, draw = vjp(dx)
    return float_leaves(draw), float_leaves(dc)
