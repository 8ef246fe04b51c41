"""Which outputs of a jaxpr depend on which of its inputs, in one pass.

`depends_on(jaxpr, marked)` says, for each output, whether it is computed
from an input marked True. Calls (jit, custom derivatives, remat, ordered
blocks: an equation with one jaxpr of its inputs' and outputs' arity) are
followed inside, and `scan` to a fixed point over its carry, so that a
weight-only output of a loop that also carries activations is told apart;
any other equation with a marked input marks all its outputs (never a
wrong "independent"). Why: residuals.py sorts a stage's vjp leaves into
per-microbatch and weight-only ones; a DCE a leaf took 3.4 s of the 6.1 s
trace of llama_4d's pp_fsdp_ep (222 leaves). Pinned by
tests/patterns/pipeline/pipeline_residuals_test.py
(`test_leaves_from_the_weights_alone_are_not_kept_a_row_a_microbatch`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax_overlap._src import _compat
  >>> f = lambda w, x: (w.T, jax.lax.scan(lambda c, _: (c @ w, w * 2), x, None, 3))
  >>> j = _compat.open_jaxpr(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((1, 2))))
  >>> depends_on(j, [False, True])     # w.T, the carry, the stacked w * 2
  [False, True, False]
"""

from __future__ import annotations

from typing import Sequence

from jax._src import core

from jax_overlap._src import _compat


def depends_on(jaxpr, marked: Sequence[bool]) -> list[bool]:
  """For each output of the open `jaxpr`, whether it depends on an input
  marked in `marked` (its consts are not marked)."""
  hit = {v for v, m in zip(jaxpr.invars, marked, strict=True) if m}
  for eqn in jaxpr.eqns:
    ins = [not isinstance(v, core.Literal) and v in hit for v in eqn.invars]
    if any(ins):
      hit.update(v for v, m in zip(eqn.outvars, _through(eqn, ins)) if m)
  return [not isinstance(v, core.Literal) and v in hit for v in jaxpr.outvars]


def _through(eqn, ins: list[bool]) -> list[bool]:
  if eqn.primitive.name == "scan":
    body = _compat.open_jaxpr(eqn.params["jaxpr"])
    consts, n = _compat.scan_counts(eqn.params)
    carry = ins[consts:consts + n]
    while True:   # a carry marked stays marked: at most n + 1 rounds
      outs = depends_on(body, ins[:consts] + carry + ins[consts + n:])
      grown = [a or b for a, b in zip(carry, outs[:n])]
      if grown == carry:
        return outs
      carry = grown
  bodies = [p for p in eqn.params.values() if _compat.is_jaxpr(p)]
  if len(bodies) == 1:
    body = _compat.open_jaxpr(bodies[0])
    if len(body.invars) == len(ins) and len(body.outvars) == len(eqn.outvars):
      return depends_on(body, ins)
  return [True] * len(eqn.outvars)

