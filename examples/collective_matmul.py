"""Collective matmul on 8 CPU devices: the ring beside the unfused version.

Run with `python examples/collective_matmul.py`. A two-layer block, sharded
over 8 devices:

  h = all_gather(x) @ w1            -> all_gather_matmul(x, w1, "d")
  y = psum_scatter(tanh(h) @ w2)    -> matmul_reduce_scatter(tanh(h), w2, "d")

Prints that values and gradients match the unfused version, then the order
of the operations in one step of each ring, read from the traced program:
the send starts, the matmul of the block already here runs, then the send
finishes.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend.core import jaxprs_in_params  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax_overlap import all_gather_matmul, matmul_reduce_scatter  # noqa: E402


def fused(x, w1, w2, bidirectional=False):
  h = all_gather_matmul(x, w1, "d", bidirectional=bidirectional)
  return matmul_reduce_scatter(jnp.tanh(h), w2, "d",
                               bidirectional=bidirectional)


def unfused(x, w1, w2):
  h = jax.lax.all_gather(x, "d", tiled=True) @ w1
  return jax.lax.psum_scatter(jnp.tanh(h) @ w2, "d", tiled=True)


def close(a, b) -> bool:
  """Equal up to float32 rounding of sums taken in another order."""
  return np.allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def ring_step(fn, *args) -> str:
  """The first start ... done window of `fn`'s traced program, as op names.

  Scalar index arithmetic is left out; what remains is the data movement
  and the compute.
  """
  def flat(jaxpr):  # nested jaxprs inlined where their equation stands
    for eqn in jaxpr.eqns:
      subs = list(jaxprs_in_params(eqn.params))
      if not subs:
        yield eqn
      for sub in subs:
        yield from flat(sub)

  names = [e.primitive.name for e in flat(jax.jit(fn).trace(*args).jaxpr)
           if any(getattr(v.aval, "ndim", 0) for v in e.outvars)]
  first = names.index("collective_start")
  last = names.index("collective_done", first)
  while last + 1 < len(names) and names[last + 1] == "collective_done":
    last += 1
  return " -> ".join(names[first:last + 1])


def main():
  n = 8
  mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  in_specs = (P("d"), P(None, "d"), P("d"))
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (4 * n, 16))       # rows sharded
  w1 = jax.random.normal(keys[1], (16, 8 * n))      # columns sharded
  w2 = jax.random.normal(keys[2], (8 * n, 16))      # rows sharded
  print(f"jax {jax.__version__} on {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices\n")

  def sharded(f):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=P("d"))

  grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))
  want = jax.jit(sharded(unfused))(x, w1, w2)
  want_grads = jax.jit(grad(sharded(unfused)))(x, w1, w2)
  for bidirectional in (False, True):
    f = sharded(lambda *a: fused(*a, bidirectional=bidirectional))
    got = jax.jit(f)(x, w1, w2)
    got_grads = jax.jit(grad(f))(x, w1, w2)
    same = all(close(a, b) for a, b in zip((got, *got_grads),
                                           (want, *want_grads)))
    kind = "two rings" if bidirectional else "one ring"
    print(f"{kind}: values and grads "
          f"{'match the unfused version' if same else 'DIFFER'}")
    if not same:
      raise SystemExit(1)

  print("\none ring step:", ring_step(sharded(fused), x, w1, w2))
  print("two-ring step:", ring_step(
      sharded(lambda *a: fused(*a, bidirectional=True)), x, w1, w2))


if __name__ == "__main__":
  main()
