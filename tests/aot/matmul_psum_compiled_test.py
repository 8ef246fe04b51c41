"""matmul_psum on the real TPU v5e and H100 compilers, ahead of time: each
chunk's sum an async pair, every one but a call's last forward sum (the next
op needs it) and first backward sum (its matmuls need it) with a matmul in
flight, forward and backward.

The program: Megatron's row-parallel matmul over the 8 devices of the
target (axis "x"), `x` (512, 1024) with its contracted dimension split, `w`
(1024, 512) by rows, the sum added to a residual varying over "x"
(`to="varying"`, so its gradient's sum is matmul_psum's too), `value_and_grad`
with respect to `x` and `w`. On TPU a sum over 8 devices is psum_start's ring
form (collectives/ring_psum.py), an all-to-all and then an all-gather, each
wanting a matmul of its own: matmul_psum computes each later chunk's
product as two matmuls there (one behind each half), and the backward has
two a chunk (dx and dw). On H100 each sum is one all-reduce, summed as one
flat buffer (quirk "gpu-flat-all-reduce": as the chunk's 2-D product it
failed to compile, "Asynchronous computation ... expected to contain only
the root and parameter instructions").
"""

from __future__ import annotations

import re

import compilers  # first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, target

import jax_overlap
from jax_overlap._src import _compat
from jax_overlap._src.patterns.leaf_scope import leaf_from_op_name

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

#: the kinds one sum compiles to: H100 an all-reduce; v5e over 8 devices the
#: ring form's two halves
KINDS = {"gpu_h100": ("all-reduce",), "tpu_v5e": ("all-to-all", "all-gather")}


def _compiled(name: str, chunks: int) -> str:
  t = target(name)

  def f(x, w, r):
    y = jax_overlap.matmul_psum(x, w, "x", chunks=chunks, to="varying")
    return jax.lax.pmean(jnp.sum(jnp.tanh(r + y)), "x")
  fn = jax.shard_map(f, mesh=t.mesh, in_specs=(P(None, "x"), P("x"), P("x")),
                     out_specs=P())
  grad = jax.value_and_grad(fn, argnums=(0, 1))
  return compilers.compiled_text(
      grad, arg(t, (512, 1024), P(None, "x")), arg(t, (1024, 512), P("x")),
      arg(t, (8 * 512, 512), P("x")))


def _sums(text: str, moving: str) -> list:
  """The windows of matmul_psum's sums of `moving` ("x @ w" forward, "dy"
  backward), in schedule order."""
  computations = schedule.scheduled(text)

  def leaf(w):
    name = re.search(r'op_name="([^"]*)"', computations[w.computation][w.start].line)
    return name and leaf_from_op_name(name.group(1))
  return [w for w in schedule.windows(text) if leaf(w) == moving]


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_every_sum_but_the_ends_has_a_matmul_in_flight(name, chunks):
  text = _compiled(name, chunks)
  kinds = KINDS[name]
  forward, backward = _sums(text, "x @ w"), _sums(text, "dy")
  for windows, what in ((forward, "forward"), (backward, "backward")):
    assert [w.kind for w in windows] == list(kinds) * chunks, (what, windows)
  with_matmul = lambda windows: [bool(w.matmuls) for w in windows]
  # forward: every chunk's sum but the last behind the next chunk's product;
  # backward: every chunk's but the first behind the previous one's dx, dw
  ends = [False] * len(kinds)
  middle = [True] * (len(kinds) * (chunks - 1))
  assert with_matmul(forward) == middle + ends, forward
  assert with_matmul(backward) == ends + middle, backward
  # none of them synchronous
  assert not re.search(r"all-reduce\([^\n]*jax_overlap\.leaf=", text)
