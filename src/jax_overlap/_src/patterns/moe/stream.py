"""`expert_stream`: the MoE exchanges of several token groups as futures.

`expert_parallel` runs one call's exchanges in one ordered block, so its
first dispatch (before any expert runs) and its last combine (after every
expert ran) have nothing to hide them. A stream takes its token groups one
`send` at a time and leaves one all-to-all in flight between calls: what the
caller writes between two calls (another group's attention, the next
layer's attention of a group already combined) runs while it travels. The
schedule, for groups `0 .. m-1` (`d(g)` a dispatch, `c(g)` a combine):

    send(x_0):   start E_0 = d(0)
    send(x_g):   finish E_{g-1}; start E_g = d(g) + c(g-2); experts(g-1)
    close():     finish E_{m-1}; start c(m-2); experts(m-1); finish it;
                 start c(m-1), finished by the last output's done()

so each all-to-all carries at most one dispatch and one combine (one in
flight at a time: TPU v5e takes no more) and every one has either the
experts or the caller's work beside it. Written with the public futures
(`all_to_all_start`) and differentiated by jax, not a `custom_vjp`: each
exchange's transpose is an all-to-all started where the forward finished
it and finished where the forward started it, so in an ordered block
(`program_order(enforce=True)`, whose backward is ordered in reverse) the
backward's exchanges are in flight behind the backward of what the forward
wrote beside them. Pinned by tests/patterns/moe/stream_test.py and
tests/aot/moe_compiled_test.py::test_a_streams_exchanges_are_all_in_flight.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_overlap._src.ordering.decorator import program_order
from jax_overlap._src.patterns.moe.arguments import (check_call,
                                                     check_expert_output,
                                                     check_stream_capacity)
from jax_overlap._src.patterns.moe.layout import (dispatch_layout,
                                                  gather_rows,
                                                  slots_per_expert)
from jax_overlap._src.patterns.moe.transport import PaddedTransport

NAME = "expert_stream"


def expert_stream(expert_fn: Callable[[Any, Any], Any], expert_params, *,
                  axis, capacity: int, recompute: bool = False) -> "ExpertStream":
  """Mixture-of-experts over token groups sent one at a time, every exchange
  a future in flight beside the experts or the caller's own work.

  Inside `jax.shard_map` over `axis` (and, for the order to hold, inside a
  `program_order(enforce=True)` block), each group sent with
  `stream.send(x, expert_ids, weights)` gets what `expert_parallel(expert_fn,
  x, expert_ids, weights, expert_params, axis=axis, capacity=capacity,
  chunks=1)` returns, by `stream.close()`'s futures, one a group, in order:
  `done()` gives `(y, dropped)`. One all-to-all is in flight after each call
  (one at a time: TPU v5e takes no more); what you write between `send`s,
  and between `close()` and the last group's `done()`, runs beside it; the
  experts of group g run beside the exchange that `send` of group g+1 (or
  `close`) starts. Gradients flow by jax's own differentiation to each
  group's `x` and `weights`, to `expert_params` and to what `expert_fn`
  closes over; in an ordered block the backward's exchanges are in flight
  too (the module's docstring says how). The experts' activations are
  saved for the backward as jax saves them, or with `recompute=True` run
  again there (`jax.checkpoint`, as `expert_parallel` does): each group
  then keeps only what arrived at its experts.

  Args:
    expert_fn: `expert_fn(expert_params_e, tokens[C, D]) -> [C, D']`, as
      `expert_parallel`'s.
    expert_params: a pytree whose leaves have a leading `E_local` dimension.
    axis: the mesh axis name the experts are spread over.
    capacity: rows each expert accepts from each source device, per group
      (an int >= 1; a stream has no dropless form: a ragged exchange is
      synchronous on GPU and TPU, so there is nothing to stream).
    recompute: run the experts' forward again in the backward instead of
      saving their activations (a bool; default False).

  Returns:
    An `ExpertStream`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jax_overlap
    >>> mesh = jax.make_mesh((2,), ('i',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> scale = lambda s, tokens: tokens * s   # expert e multiplies by s[e]
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P('i'), out_specs=P('i'))
    ... @jax_overlap.program_order(enforce=True)
    ... def f(x, ids, w, s):
    ...   stream = jax_overlap.expert_stream(scale, s, axis='i', capacity=2)
    ...   stream.send(x[:1], ids[:1], w[:1])
    ...   other = x[1:] + 1.0            # beside the first dispatch
    ...   stream.send(other, ids[1:], w[1:])
    ...   first, last = stream.close()
    ...   y0, _ = first.done()
    ...   y1, _ = last.done()
    ...   return jnp.concatenate([y0, y1])
    >>> x = jnp.ones((4, 2))
    >>> ids = jnp.array([[0], [1], [1], [0]])   # 2 experts, one on each device
    >>> f(x, ids, jnp.ones((4, 1)), jnp.array([2.0, 3.0]))
    Array([[2., 2.],
           [6., 6.],
           [3., 3.],
           [4., 4.]], dtype=float32)
  """
  if not callable(expert_fn):
    raise TypeError(
        f"{NAME}(expert_fn=...) must be a function "
        f"expert_fn(expert_params_e, tokens[C, D]) -> [C, D'], got "
        f"{expert_fn!r}.")
  if not isinstance(recompute, bool):
    raise TypeError(f"{NAME}(recompute=...) must be True or False, got "
                    f"{recompute!r}.")
  return ExpertStream(expert_fn, expert_params, axis,
                      check_stream_capacity(NAME, capacity), recompute)


class _Group:
  """One sent group: its call, layout and, as they come, its buffers."""

  def __init__(self, call, layout, weights):
    self.call, self.layout, self.weights = call, layout, weights
    self.arrived = None     # its tokens at the experts
    self.reply = None       # the experts' outputs, to send back
    self.returned = None    # the outputs back here


class ExpertStream:
  """An `expert_stream`: `send` groups, then `close()` once."""

  def __init__(self, expert_fn, expert_params, axis, capacity,
               recompute=False):
    self._fn, self._params, self._axis = expert_fn, expert_params, axis
    self._capacity, self._recompute = capacity, recompute
    self._groups: list[_Group] = []
    self._flight = None     # (the exchange, its dispatch group, its combine group)
    self._closed = False

  def send(self, x, expert_ids, weights) -> None:
    """Sends group `x [T, D]` (`expert_ids`, `weights` `[T, k]`) to its
    experts: finishes the exchange in flight, starts this group's dispatch
    with the combine of the group two back, and runs the previous group's
    experts beside it."""
    if self._closed:
      raise ValueError(f"{NAME}: send() after close(); start a new stream.")
    call = check_call(self._fn, x, expert_ids, weights, self._params,
                      axis=self._axis, capacity=self._capacity, chunks=1,
                      name=f"{NAME}(...).send")
    x, weights = jnp.asarray(x), jnp.asarray(weights)
    layout = dispatch_layout(
        jnp.asarray(expert_ids), experts=call.experts, chunks=1,
        capacity=call.capacity,
        per_expert=slots_per_expert(call.tokens, call.k, call.capacity, 1))
    group = _Group(call, layout, weights)
    self._finish()
    buffer = _free(lambda: _as_buffer(call, gather_rows(
        x, layout.pair_in_slot[0] // call.k)))
    self._start(dispatch=group, buffer=buffer, combine=self._back(2))
    if self._groups:
      self._experts(self._groups[-1])
    self._groups.append(group)

  def close(self) -> list["GroupOutput"]:
    """The groups' outputs, one `GroupOutput` a group in the order sent:
    every group's but the last is ready; the last one's combine is in
    flight until its `done()`."""
    if self._closed:
      raise ValueError(f"{NAME}: close() called twice.")
    if not self._groups:
      raise ValueError(f"{NAME}: close() before any send(); send a group "
                       "of tokens first.")
    self._closed = True
    self._finish()
    last = self._groups[-1]
    combine = self._back(2)
    if combine is not None:
      self._start(dispatch=None, buffer=None, combine=combine)
    self._experts(last)
    self._finish()
    self._start(dispatch=None, buffer=None, combine=last)
    outputs = [GroupOutput(self, g) for g in self._groups]
    return outputs

  # --- the schedule's pieces ---------------------------------------------------

  def _back(self, n: int):
    """The group `n` back from the last sent, whose reply goes back now."""
    if len(self._groups) >= n and self._groups[-n].reply is not None:
      return self._groups[-n]
    return None

  def _start(self, *, dispatch, buffer, combine):
    transport = PaddedTransport(self._axis, dispatch.call.size if dispatch
                                else combine.call.size)
    legs = {}
    if dispatch is not None:
      legs["dispatch"] = (0, buffer)
    if combine is not None:
      legs["combine"] = (0, combine.reply)
      combine.reply = None
    # One dtype, so that the legs concatenate without a bitcast (which has
    # no derivative): the common type, cast back after.
    dtypes = {k: b.dtype for k, (_, b) in legs.items()}
    common = jnp.result_type(*dtypes.values())
    legs = {k: (c, b.astype(common)) for k, (c, b) in legs.items()}
    self._flight = (transport.start(**legs), dispatch, combine, dtypes)

  def _finish(self):
    if self._flight is None:
      return
    exchange, dispatch, combine, dtypes = self._flight
    self._flight = None
    arrived, returned = exchange.done()
    if dispatch is not None:
      dispatch.arrived = arrived.astype(dtypes["dispatch"])
    if combine is not None:
      combine.returned = returned.astype(dtypes["combine"])

  def _experts(self, group: _Group):
    fn, params = self._fn, self._params
    call = group.call

    def run(params, arrived):
      tokens = _to_experts(arrived)
      out = jax.vmap(fn)(params, tokens)
      check_expert_output(out, tokens, call.experts_local, name=NAME)
      return _from_experts(call, out)
    if self._recompute:
      run = jax.checkpoint(run)
    group.reply = _free(run, params, group.arrived)
    group.arrived = None

  def _output(self, group: _Group):
    if group.returned is None:        # the last group: its combine in flight
      self._finish()
    call, layout = group.call, group.layout
    rows = group.returned.reshape(-1, group.returned.shape[-1])
    outs = gather_rows(rows, layout.slot_of_pair).reshape(call.tokens, call.k,
                                                          -1)
    w = group.weights.astype(jnp.result_type(group.weights, outs))
    return jnp.einsum("tk,tkd->td", w, outs), layout.dropped


class GroupOutput:
  """One group's output: `done()` gives `(y [T, D'], dropped)`; the last
  group's finishes the stream's last combine (call it after the work that
  should run beside it)."""

  def __init__(self, stream: ExpertStream, group: _Group):
    self._stream, self._group, self._value = stream, group, None

  def done(self):
    if self._value is None:
      self._value = self._stream._output(self._group)
    return self._value


def _free(fn, *args):
  """`fn(*args)` as one free step of the enclosing ordered block."""
  return program_order(enforce=False)(fn)(*args)


def _as_buffer(call, flat):
  """[E * C, D] -> [axis_size, E_local, C, D], block d for device d."""
  rows, d = flat.shape
  return flat.reshape(call.size, call.experts_local, rows // call.experts, d)


def _to_experts(arrived):
  """[axis_size, E_local, C, D] from each source -> [E_local, sources * C, D]."""
  n, e, c, d = arrived.shape
  return arrived.transpose(1, 0, 2, 3).reshape(e, n * c, d)


def _from_experts(call, out):
  """[E_local, sources * C, D] -> [axis_size, E_local, C, D] back to each."""
  e, rows, d = out.shape
  return out.reshape(e, call.size, rows // call.size, d).transpose(1, 0, 2, 3)
