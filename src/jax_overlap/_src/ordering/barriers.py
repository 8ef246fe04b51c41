"""The barrier interpreter: re-emits an ordered body with the fences in it.

`run_in_order` evaluates a body equation by equation with `bind`, and before
each equation B (after the first) ties the previous equation A to B with
`optimization_barrier`s, so no backend may move B's work above A's or A's
below B's. Which values go through which barrier is the contract that jax's
own `program_order` also follows (the conformance suite pins the counts):

* plain B: one barrier over A's outputs that B does not consume, together
  with B's non-literal inputs;
* B with no non-literal input (an iota, a constant): a token is tied to A's
  outputs and B is called with the token as its only argument;
* B a free block or a jit call: a token is tied to A's outputs by one
  barrier, and each input of B that A did not produce gets a barrier of its
  own with that token (a free block's excluded inputs pass untouched);
* an equation that nothing ties to A but a token (an input-free one) or
  nothing at all (a device position, computed in place) does not count as
  A: the equation after it is fenced after both, A's outputs going through
  its barrier too (the barrier counts stay jax's).

It runs while a program is lowered: from `to_lojax` on jax >= 0.12, from the
MLIR lowering rule on older jax. Nowhere else.

With `leave_in_flight` (jax < 0.12 lowering for TPU/GPU,
`not _compat.ASYNC_CUSTOM_CALLS`), a future's in-flight value (a
`collective_start`'s first output, there the plain collective's result)
goes through no barrier but the one that fences the equation reading it
(its done): the collective then may finish anywhere up to its done, and
XLA's async conversion puts the written work in its window. The barriers
stay where they are (the other values keep them).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import jax
from jax._src import core
from jax._src.pjit import jit_p

from jax_overlap._src import _compat
from jax_overlap._src.ordering import barrier_op, block_collectives
from jax_overlap._src.ordering.primitive import is_free_block


#: Equations whose lowering reads the device's position (`partition-id`) are
#: computed in place, not fenced: tied to a token, an input-free equation
#: becomes a late-inlined call, and inside shard_map XLA's SPMD partitioner
#: refuses a `partition-id` in such a call ("not supported for SPMD
#: partitioning since the meaning is ambiguous"; jax's own program_order
#: fails the same way). The device's position costs nothing to compute, so
#: there is no order to keep.
_READS_DEVICE_POSITION = frozenset({"axis_index"})

#: The primitive whose first output is a future's in-flight value.
_STARTS = "collective_start"


def run_in_order(closed, args: Sequence[Any], *, strict_in: bool,
                 strict_out: bool, leave_in_flight: bool = False) -> list[Any]:
  """Evaluates `closed` on `args` with the barriers that fix its order
  (`leave_in_flight`: see the module docstring)."""
  # The collectives' rewrites (psum_start's ring form on TPU: its all-gather
  # half moves up into the reduce-scatter half's window, ring_psum.py).
  jaxpr = block_collectives.rewrite(_compat.open_jaxpr(closed))
  env: dict[core.Var, Any] = {}
  in_flight = frozenset(eqn.outvars[0] for eqn in jaxpr.eqns
                        if leave_in_flight and eqn.primitive.name == _STARTS)
  # Plain collectives that read nothing of the step before (fsdp_scan's next
  # layer's shards) XLA's combiners merge across steps into one, before the
  # first: tied to the block's other inputs, each waits for its step.
  strict_in = strict_in or bool(in_flight)

  def read(atom):
    return _constant(atom) if _is_constant(atom) else env[atom]

  def write(outvars, vals):
    for v, x in zip(outvars, vals, strict=True):
      if not isinstance(v, core.DropVar):
        env[v] = x

  write(jaxpr.constvars, _compat.jaxpr_consts(closed))
  args = list(args)
  if strict_in and args:
    args = barrier_op.barrier(args)
  write(jaxpr.invars, args)

  # `prev` stands for the equation A before B: the outputs B is fenced
  # after. An equation that no data edge ties to the one before it (an
  # input-free call: its token is gone once XLA inlines it; a device
  # position, computed in place) does not end the chain: A's outputs are
  # carried on with its own, and the next equation is fenced after both.
  # Else the order A -> C rests on that lost edge alone. A collective
  # matmul ring's first step starts a send, then casts the literal block
  # size to vary over the ring's axis (an input-free equation), then slices
  # and multiplies the block: the TPU v5p compiler runs that matmul before
  # the send starts unless it is fenced, leaving its window empty
  # (tests/aot/real_compilers_test.py::
  # test_collective_matmul_sends_behind_block_matmuls). A call of literals
  # alone (a jit such as jnp's remainder, a block) holds constants of its
  # own, which the late-inlined call would clone with its control edges
  # (XLA's CSE then aborts, TPU and GPU): it is fenced as the others are, the
  # token tied to what came before, but bound outside that call, so nothing
  # ties it to the token (test_an_ordered_block_with_calls_of_literals_compiles).
  prev_eqn, prev, prev_vals = None, None, None
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    literal = [_is_constant(v) for v in eqn.invars]
    carry = prev is not None
    if prev is None:
      with _scope_of(eqn, len(jaxpr.eqns)):
        outs = _compat.bind_eqn(eqn, invals)
    elif eqn.primitive.name in _READS_DEVICE_POSITION:
      outs = _compat.bind_eqn(eqn, invals)
    elif all(literal):
      token = _compat.new_token()
      prev_vals, token = _fence_with_token(prev, prev_vals, token, in_flight)
      if _calls(eqn):
        outs = _compat.bind_eqn(eqn, invals)
      else:
        # The literals go in as the call's operands, so the late-inlined
        # call holds no constant (see `_compat.call_after_token`).
        outs = _compat.call_after_token(
            lambda *vals, eqn=eqn: _compat.bind_eqn(eqn, vals), token, invals)
    elif is_free_block(eqn) or eqn.primitive is jit_p:
      carry = False
      fenced = [not lit for lit in literal]
      if is_free_block(eqn):
        fenced = [f and not ex for f, ex in zip(fenced, eqn.params["excluded"])]
      if any(fenced):
        prev_vals, invals = _fence_each_input(prev, prev_vals, eqn,
                                              invals, fenced, in_flight)
      outs = _compat.bind_eqn(eqn, invals)
    else:
      carry = False
      prev_vals, invals = _fence_together(prev, prev_vals, eqn, invals,
                                          literal, in_flight)
      outs = _compat.bind_eqn(eqn, invals)
    if prev is not None:
      write(prev.outvars, prev_vals)
    write(eqn.outvars, outs)
    if carry:
      prev = _Outputs([*prev.outvars, *eqn.outvars])
      prev_vals = [*prev_vals, *outs]
    else:
      prev, prev_vals = _Outputs(list(eqn.outvars)), list(outs)
    prev_eqn = eqn

  if (prev_eqn is not None and len(jaxpr.eqns) > 1 and prev_vals
      and block_collectives.is_synchronous(prev_eqn.primitive.name)):
    write(prev.outvars, barrier_op.barrier(prev_vals))
  outs = [read(v) for v in jaxpr.outvars]
  if strict_out and outs:
    outs = barrier_op.barrier(outs)
  return outs


class _Outputs(NamedTuple):
  """The variables the next equation is fenced after (see `run_in_order`)."""

  outvars: list


def _scope_of(eqn, count: int):
  """`block_collectives.FENCED_SCOPE` for a synchronous collective that starts a
  block of more than one equation: it reads the block's inputs, which no
  barrier fences, so `compile_options.fenced_sync_collectives` tells it by
  this scope in its location (the others by their barriers; tests/aot/
  real_compilers_test.py::test_a_plain_gather_in_an_ordered_block_is_said)."""
  if count > 1 and block_collectives.is_synchronous(eqn.primitive.name):
    return jax.named_scope(block_collectives.FENCED_SCOPE)
  return contextlib.nullcontext()


def _calls(eqn) -> bool:
  """Whether `eqn` holds a jaxpr (a jit, a block, a checkpoint)."""
  return any(hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")
             for v in eqn.params.values())


def _is_constant(atom) -> bool:
  """A literal, or a bare constant: older jax's jax_remat3 leaves some
  arrays in a jaxpr's equations unwrapped (jax's own evaluator then fails on
  them; tests/integration/fuzz_regressions_test.py)."""
  return isinstance(atom, core.Literal) or not isinstance(atom, core.Var)


def _constant(atom):
  return atom.val if isinstance(atom, core.Literal) else atom


def _fence_with_token(prev, prev_vals, token, in_flight):
  """A's outputs (but those in flight) and a new token, through one barrier."""
  tied = [i for i, v in enumerate(prev.outvars) if v not in in_flight]
  *fenced, token = barrier_op.barrier([*(prev_vals[i] for i in tied), token])
  prev_vals = list(prev_vals)
  for i, x in zip(tied, fenced):
    prev_vals[i] = x
  return prev_vals, token


def _fence_together(prev, prev_vals, eqn, invals, literal, in_flight):
  """One barrier over A's unconsumed outputs (but those in flight) and B's
  non-literal inputs."""
  consumed = set(v for v in eqn.invars if not _is_constant(v))
  kept = [i for i, v in enumerate(prev.outvars)
          if v not in consumed and v not in in_flight]
  fed = [i for i, lit in enumerate(literal) if not lit]
  fenced = barrier_op.barrier([*(prev_vals[i] for i in kept),
                            *(invals[i] for i in fed)])
  kept_vals, fed_vals = fenced[:len(kept)], fenced[len(kept):]
  prev_vals, invals = list(prev_vals), list(invals)
  for i, x in zip(kept, kept_vals):
    prev_vals[i] = x
  for i, x in zip(fed, fed_vals):
    invals[i] = x
  return prev_vals, invals


def _fence_each_input(prev, prev_vals, eqn, invals, fenced, in_flight):
  """A token after A; each fenced input of B not made by A waits for it."""
  token = _compat.new_token()
  prev_vals, token = _fence_with_token(prev, prev_vals, token, in_flight)
  made_by_prev = {v: i for i, v in enumerate(prev.outvars)
                  if not isinstance(v, core.DropVar)}
  invals = list(invals)
  for k, (v, f) in enumerate(zip(eqn.invars, fenced)):
    if not f:
      continue
    if v in made_by_prev:
      invals[k] = prev_vals[made_by_prev[v]]
    else:
      _, invals[k] = barrier_op.barrier([token, invals[k]])
  return list(prev_vals), invals
