"""`expert_parallel`: the public function and its overlapped backward pass."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.moe.arguments import (Call, check_call,
                                                     check_expert_output)
from jax_overlap._src.patterns.moe.layout import (dispatch_layout,
                                                  gather_rows,
                                                  slots_per_expert)
from jax_overlap._src.patterns.moe.pipeline import exchange_pipeline
from jax_overlap._src.patterns.moe.ragged_exchange import received_sizes
from jax_overlap._src.patterns.moe.transport import choose_transport
from jax_overlap._src.patterns.moe.varying import vary_like


def expert_parallel(expert_fn: Callable[[Any, Any], Any], x, expert_ids,
                    weights, expert_params, *, axis, capacity=None,
                    chunks: int = 2):
  """Mixture-of-experts dispatch, experts and combine, the exchanges overlapped.

  Inside `jax.shard_map` over `axis`, whose devices each hold `E_local`
  experts (`E = E_local * axis_size` in all; expert `e` lives on device
  `e // E_local`), computes

      y[t] = sum_j weights[t, j] * expert_fn(params[expert_ids[t, j]], x[t])

  for this device's tokens. Routing (which experts, what weights) stays
  yours; this function sends each (token, choice) to its expert's device
  (an all-to-all), runs `expert_fn` on each local expert's tokens, sends
  the outputs back (a second all-to-all) and combines them.

  The exchange is split into `chunks` (of each expert's slots, below): one
  all-to-all carrying the dispatch of chunk c+1 and the combine of chunk
  c-1 is in flight while the experts compute chunk c, every step fenced
  with `program_order` (one exchange in flight at a time: TPU v5e takes no
  more). The backward pass (a `jax.custom_vjp`) is overlapped the same way:
  output cotangents travel to the experts while the experts' backward of
  the chunk before runs, and token cotangents travel back. Gradients flow to `x`, `weights` and
  `expert_params`, not to `expert_ids`. The tokens each expert received are
  saved for the backward pass, which runs `expert_fn` again under
  `jax.vjp` (its internals are not saved).

  Capacity: within each (source device, expert) pair, (token, choice) pairs
  claim capacity in token order, then choice order, over all of this
  device's tokens (so what is dropped does not depend on `chunks`); pairs
  over it contribute 0. Each expert has `C = min(capacity, T * k)` slots
  for this device, and chunk c sends slots `[c * C / chunks, (c + 1) * C /
  chunks)` of every expert (`ceil(C / chunks)` rows each), so the chunks
  together send what one exchange would. `capacity=None` is dropless:
  buffers of the worst case, `C = T * k`, of which on GPU and TPU only the
  routed rows travel, by `jax.lax.ragged_all_to_all`; that runs
  synchronously there (XLA has no async ragged all-to-all a program can
  place; a `CollectiveNotAsyncWarning` says so at compile time), so a
  dropless pass overlaps nothing: give a capacity for the overlap. CPU,
  which cannot run a ragged all-to-all, sends the padded buffers. The form
  is chosen per platform when the program is lowered.

  An id outside `[0, E)` is an error when `expert_ids` is known at the call
  (a NumPy array); a traced one cannot be checked and is dropped: that
  choice contributes 0 (and is counted in `dropped`).

  Args:
    expert_fn: `expert_fn(expert_params_e, tokens) -> out`, one expert's
      parameters (the leaves of `expert_params` without their leading
      dimension) and its tokens `[C, D]`, returning `[C, D']`. Applied to
      every local expert with `jax.vmap`. Give it its parameters through
      `expert_params`: values it closes over get no gradient.
    x: `[T, D]`, this device's tokens.
    expert_ids: `[T, k]` integers in `[0, E)`, each token's chosen experts.
    weights: `[T, k]`, their combine weights (floating point).
    expert_params: a pytree whose leaves have a leading `E_local` dimension:
      this device's experts.
    axis: the mesh axis name (one name) the experts are spread over.
    capacity: rows each expert accepts from each source device, an int >= 1,
      or None (dropless).
    chunks: how many chunks each expert's slots are split into (it must
      divide `T`); 1 overlaps nothing.

  Returns:
    `y`, `[T, D']`, or with a capacity `(y, dropped)`, `dropped` this
    device's number of dropped (token, choice) pairs (int32).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> scale = lambda s, tokens: tokens * s   # expert e multiplies by s[e]
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... def f(x, ids, w, s):
    ...   return jax_overlap.expert_parallel(scale, x, ids, w, s, axis='i')
    >>> x = jnp.ones((4, 2))
    >>> ids = jnp.array([[0], [1], [1], [0]])   # 2 experts, one on each device
    >>> f(x, ids, jnp.ones((4, 1)), jnp.array([2.0, 3.0]))
    Array([[2., 2.],
           [3., 3.],
           [3., 3.],
           [2., 2.]], dtype=float32)
  """
  call = check_call(expert_fn, x, expert_ids, weights, expert_params,
                    axis=axis, capacity=capacity, chunks=chunks)
  x = jnp.asarray(x)
  weights = jnp.asarray(weights)
  expert_params = jax.tree.map(jnp.asarray, expert_params)
  # Every operand varies over whatever any of them varies over, so that the
  # custom_vjp's cotangents have their primals' types (jax sums the
  # cotangent of a cast back over the axes it added).
  every = (x, weights, expert_params)
  x, weights = vary_like(x, every, axis=axis), vary_like(weights, every,
                                                          axis=axis)
  expert_params = jax.tree.map(lambda p: vary_like(p, every, axis=axis),
                               expert_params)
  per_expert = _per_expert(call)
  layout = dispatch_layout(jnp.asarray(expert_ids), experts=call.experts,
                           chunks=call.chunks, capacity=call.capacity,
                           per_expert=per_expert)
  # Values expert_fn closes over (a traced scale, a shared weight) become
  # explicit inputs, so that their gradients flow through the custom_vjp.
  example = vary_like(
      jnp.zeros((call.size * per_expert, x.shape[1]), x.dtype), x)
  one_expert = jax.tree.map(lambda p: p[0], expert_params)
  closed_fn, consts = jax.closure_convert(expert_fn, one_expert, example)
  # Dropless sends only the routed rows (a ragged exchange): each side
  # needs the rows of every (chunk, expert) it sends and receives, known
  # before the ordered pipeline (one small all-to-all of the counts).
  sizes = None
  if call.capacity is None and call.size > 1:
    sizes = (layout.sent, received_sizes(layout.sent, axis=call.axis,
                                         experts_local=call.experts_local))
  y = _expert_parallel(call, closed_fn, x, weights,
                       (expert_params, tuple(consts)), layout.pair_in_slot,
                       layout.slot_of_pair, sizes)
  return y if call.capacity is None else (y, layout.dropped)


# --- the two passes -------------------------------------------------------------

def _all_experts(expert_fn, params_and_consts, tokens):
  """`expert_fn` on every local expert: params [E_local, ...] and tokens
  [E_local, rows, D]; the closed-over values shared by all."""
  params, consts = params_and_consts
  return jax.vmap(lambda p, t: expert_fn(p, t, *consts))(params, tokens)


def _run_experts(call: Call, expert_fn, params, tokens):
  out = _all_experts(expert_fn, params, tokens)
  check_expert_output(out, tokens, call.experts_local)
  return out


def _to_experts(call: Call, arrived):
  """[axis_size, E_local, C, D] from each source -> [E_local, sources * C, D]."""
  n, e, c, d = arrived.shape
  return arrived.transpose(1, 0, 2, 3).reshape(e, n * c, d)


def _from_experts(call: Call, out):
  """[E_local, sources * C, D] -> [axis_size, E_local, C, D] back to each."""
  e, rows, d = out.shape
  n = call.size
  return out.reshape(e, n, rows // n, d).transpose(1, 0, 2, 3)


def _per_expert(call: Call) -> int:
  return slots_per_expert(call.tokens, call.k, call.capacity, call.chunks)


def _as_buffer(call: Call, flat):
  """[E * C_c, D] -> [axis_size, E_local, C_c, D], block d for device d."""
  rows, d = flat.shape
  return flat.reshape(call.size, call.experts_local,
                      rows // call.experts, d)


def _per_pair(call: Call, returned, slot_of_pair):
  """Each (token, choice)'s row, [T, k, D], of the chunks' returned buffers
  ([axis_size, E_local, C_c, D] each, block s from device s: its experts'
  slots); 0 for a dropped pair."""
  stacked = jnp.concatenate([r.reshape(-1, r.shape[-1]) for r in returned])
  return gather_rows(stacked, slot_of_pair).reshape(call.tokens, call.k, -1)


def _forward(call: Call, expert_fn, x, weights, params, pair_in_slot,
             slot_of_pair, sizes, *, save: bool):
  """(y, residuals): with `save`, the tokens each expert received (per
  chunk) and each (token, choice)'s expert output; else None."""
  transport = choose_transport(call.axis, call.size, sizes)

  def send(c):
    # Slot -> its pair's token (pair // k); an empty slot's T reads 0.
    return _as_buffer(call, gather_rows(x, pair_in_slot[c] // call.k))

  def compute(c, arrived):
    tokens = _to_experts(call, arrived)
    out = _run_experts(call, expert_fn, params, tokens)
    return _from_experts(call, out), (tokens if save else None)

  with moving("tokens"):
    returned, received = exchange_pipeline(transport, call.chunks, send=send,
                                           compute=compute)
  outs = _per_pair(call, returned, slot_of_pair)
  w = weights.astype(jnp.result_type(weights, outs))
  y = jnp.einsum("tk,tkd->td", w, outs)
  if not save:
    return y, None
  return y, (received, outs)


def _backward(call: Call, expert_fn, weights, params, pair_in_slot,
              slot_of_pair, sizes, received, outs, dy):
  transport = choose_transport(call.axis, call.size, sizes)
  experts = lambda p, t: _all_experts(expert_fn, p, t)
  weight_of_pair = weights.reshape(-1).astype(dy.dtype)

  def send(c):
    # The cotangent of each slot's (token, choice) output: its weight times
    # its token's dy (0 for an empty slot).
    pair = pair_in_slot[c]
    rows = gather_rows(weight_of_pair, pair)[:, None] \
        * gather_rows(dy, pair // call.k)
    return _as_buffer(call, rows.astype(outs.dtype))

  def compute(c, arrived):
    _, pull = jax.vjp(experts, params, received[c])
    d_params, d_tokens = pull(_to_experts(call, arrived))
    return _from_experts(call, d_tokens), d_params

  with moving("cotangents"):
    returned, d_params = exchange_pipeline(transport, call.chunks, send=send,
                                           compute=compute)
  dx = _per_pair(call, returned, slot_of_pair).sum(axis=1)
  d_params = jax.tree.map(_sum_over_chunks, *d_params)
  d_weights = jnp.einsum("td,tkd->tk", dy, outs.astype(dy.dtype))
  return dx, d_weights, d_params


def _sum_over_chunks(*grads):
  if grads[0].dtype == jax.dtypes.float0:    # an integer leaf: no gradient
    return grads[0]
  return sum(grads[1:], grads[0])


def _cotangent_for(grad, primal):
  if not jnp.issubdtype(primal.dtype, jnp.inexact):
    return np.zeros(primal.shape, jax.dtypes.float0)
  return grad.astype(primal.dtype)


def _expert_parallel_impl(call, expert_fn, x, weights, params, pair_in_slot,
                          slot_of_pair, sizes):
  return _forward(call, expert_fn, x, weights, params, pair_in_slot,
                  slot_of_pair, sizes, save=False)[0]


def _fwd(call, expert_fn, x, weights, params, pair_in_slot, slot_of_pair,
         sizes):
  y, (received, outs) = _forward(call, expert_fn, x, weights, params,
                                 pair_in_slot, slot_of_pair, sizes, save=True)
  return y, (weights, params, pair_in_slot, slot_of_pair, sizes, received,
             outs)


def _bwd(call, expert_fn, residuals, dy):
  weights, params, pair_in_slot, slot_of_pair, sizes, received, outs = \
      residuals
  dx, d_weights, d_params = _backward(call, expert_fn, weights, params,
                                      pair_in_slot, slot_of_pair, sizes,
                                      received, outs, dy)
  d_params = jax.tree.map(_cotangent_for, d_params, params)
  # The tokens travelled in x's dtype.
  return (dx.astype(received[0].dtype), d_weights.astype(weights.dtype),
          d_params, None, None, None)


_expert_parallel = jax.custom_vjp(_expert_parallel_impl,
                                  nondiff_argnums=(0, 1))
_expert_parallel.defvjp(_fwd, _bwd)
