"""expert_parallel on the real TPU v5e and H100 compilers, ahead of time.

With `chunks=c`, a pass (the forward, or the backward of value_and_grad)
has 2c all-to-alls: c dispatches and c combines. Chunk i+1's dispatch and
chunk i-1's combine are started before the experts compute chunk i and
finished after, so in the compiled schedule every all-to-all of a pass but
its first (chunk 0's dispatch, before any expert runs) and its last (the
last chunk's combine, after every expert ran) has an expert matmul between
its start and its done. The expert's matmuls are found by name (a
`jax.named_scope`, which the backward's transposed matmuls keep).

Shapes are tiny (32 tokens a device of width 16, 16 experts, 2 a device) and
each program compiles once a module (`_compiled` caches by its arguments).
"""

from __future__ import annotations

import functools
import re

import compilers  # first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, compiled_text, target

import jax_overlap
from jax_overlap._src import _compat

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

TOKENS, WIDTH, HIDDEN, LOCAL, K = 32, 16, 32, 2, 2
CAPACITY = 8          # of an average 32 x 2 / 16 = 4 a (device, expert) pair
EXPERT_SCOPE = "moe_expert"


def expert(params, tokens):
  with jax.named_scope(EXPERT_SCOPE):
    return jnp.tanh(tokens @ params["w_in"]) @ params["w_out"]


def is_expert_matmul(instr: schedule.Instr) -> bool:
  return bool(re.search(rf'op_name="[^"]*{EXPERT_SCOPE}[^"]*dot_general', instr.line))


def moe_program(t, chunks: int, grad: bool):
  n = t.n

  def block(x, ids, weights, params):
    y, dropped = jax_overlap.expert_parallel(
        expert, x, ids, weights, params, axis="x", capacity=CAPACITY, chunks=chunks)
    return y, dropped[None]

  moe = jax.shard_map(block, mesh=t.mesh, in_specs=(P("x"),) * 4,
                      out_specs=(P("x"), P("x")))
  fn = moe
  if grad:
    fn = jax.value_and_grad(lambda *a: jnp.sum(moe(*a)[0] ** 2), argnums=(0, 2, 3))
  experts = LOCAL * n
  args = (arg(t, (n * TOKENS, WIDTH), P("x")),
          arg(t, (n * TOKENS, K), P("x"), jnp.int32),
          arg(t, (n * TOKENS, K), P("x")),
          {"w_in": arg(t, (experts, WIDTH, HIDDEN), P("x")),
           "w_out": arg(t, (experts, HIDDEN, WIDTH), P("x"))})
  return fn, args


@functools.cache
def _compiled(name: str, chunks: int, grad: bool) -> str:
  fn, args = moe_program(target(name), chunks, grad)
  return compiled_text(fn, *args)


def all_to_all_windows(text: str) -> list[schedule.Window]:
  """The async all-to-alls of the scheduled module (start, what runs, done)."""
  return [w for w in schedule.windows(text) if w.kind == "all-to-all"]


CASES = [pytest.param(name, chunks, grad,
                      id=f"{name}-chunks{chunks}-{'value_and_grad' if grad else 'forward'}")
         for name in ("gpu_h100", "tpu_v5e") for chunks in (2, 4)
         for grad in (False, True)]

#: (target, chunks, grad) -> why the overlap is short there today (xfail).
SHORT_TODAY: dict = {}


@pytest.mark.parametrize("name,chunks,grad", CASES)
def test_all_to_alls_are_in_flight_across_the_expert_matmuls(name, chunks, grad):
  text = _compiled(name, chunks, grad)
  pairs = all_to_all_windows(text)
  in_flight = [w for w in pairs if any(map(is_expert_matmul, w.between))]
  # Of each pass's 2 * chunks all-to-alls, all but its first and its last.
  wanted = 2 * (chunks - 1) * (2 if grad else 1)
  if len(in_flight) < wanted and (name, chunks, grad) in SHORT_TODAY:
    pytest.xfail(f"{SHORT_TODAY[name, chunks, grad]} (measured {len(in_flight)} of "
                 f"{wanted})")
  assert len(in_flight) >= wanted, (
      f"{len(in_flight)} of {len(pairs)} async all-to-alls have an expert matmul "
      f"in flight; wanted {wanted}",
      [(w.computation, w.start, w.done, sum(map(is_expert_matmul, w.between)))
       for w in pairs])
