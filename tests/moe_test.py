"""expert_parallel: values, drops and gradients against a dense reference,
the overlap in the traced and compiled programs, the docstring example.

The reference sends nothing: every (token, choice) goes through its expert
gathered by hand (`params[expert_ids]`), and the drop rule is applied in
NumPy on each device's tokens (token order, then choice order, per
(source device, expert) pair). The cases cover each value of each
dimension (axis size 1, 2, 4, 8; E_local 1, 2; k 1, 2; chunks 1, 2, 4;
capacity large, tight, dropless; jit and jax.checkpoint, gradients in
every case) pairwise-ish rather than as a product, for CI's budget; jax
0.10.2 and 0.11.0 run OLDER_JAX_CASES.
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives.primitives import (collective_done_p,
                                                     collective_start_p)
from jax_overlap._src.patterns.moe import expert_parallel as moe_module

import lowered

NEWEST = not jax.__version__.startswith(("0.10.", "0.11."))
T, D = 8, 8          # tokens per device, model width

# (axis size, E_local, k, chunks, capacity, mode)
CASES = [
    (1, 2, 2, 2, "none", "jit"),
    (2, 1, 1, 4, "tight", "jit"),
    (2, 2, 2, 1, "large", "checkpoint"),
    (4, 1, 2, 2, "tight", "checkpoint"),
    (4, 2, 1, 4, "none", "jit"),
    (8, 1, 2, 4, "large", "jit"),
    (8, 2, 1, 2, "tight", "jit"),
    (8, 2, 2, 2, "none", "checkpoint"),
]
OLDER_JAX_CASES = [CASES[1], CASES[3], CASES[7]]


def _mesh(n):
  return jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def expert(p, tokens):
  return jnp.tanh(tokens @ p["w"]) + p["b"]


def _inputs(n, experts_local, k, seed=0):
  E = n * experts_local
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (n * T, D))
  # Half the choices go to experts 0 and 1, so a tight capacity drops.
  ids = jnp.where(jax.random.uniform(ks[1], (n * T, k)) < 0.5,
                  jax.random.randint(ks[2], (n * T, k), 0, min(2, E)),
                  jax.random.randint(ks[3], (n * T, k), 0, E))
  weights = jax.random.uniform(ks[4], (n * T, k))
  kw, kb = jax.random.split(ks[5])
  params = {"w": jax.random.normal(kw, (E, D, D)) / np.sqrt(D),
            "b": jax.random.normal(kb, (E, D))}
  return x, ids, weights, params


def _capacity(kind, k):
  return {"none": None, "large": T * k, "tight": 2}[kind]


def kept_by_the_rule(ids, n, capacity):
  """[n*T, k] bool: (token, choice) pairs kept, and each device's drops."""
  ids = np.asarray(ids)
  kept = np.ones(ids.shape, bool)
  dropped = np.zeros(n, np.int32)
  if capacity is None:
    return kept, dropped
  for s in range(n):
    counts = {}
    for t in range(s * T, (s + 1) * T):
      for j in range(ids.shape[1]):
        e = int(ids[t, j])
        counts[e] = counts.get(e, 0) + 1
        if counts[e] > capacity:
          kept[t, j] = False
          dropped[s] += 1
  return kept, dropped


def dense_reference(kept):
  def ref(x, ids, weights, params):
    chosen = jax.tree.map(lambda a: a[ids], params)          # [T, k, ...]
    tokens = jnp.broadcast_to(x[:, None], (*ids.shape, x.shape[-1]))
    out = jax.vmap(jax.vmap(expert))(chosen, tokens)
    return jnp.einsum("tk,tkd->td", weights * kept, out)
  return ref


def ours(n, chunks, capacity, mode):
  def local(x, ids, weights, params):
    out = jo.expert_parallel(expert, x, ids, weights, params, axis="i",
                             capacity=capacity, chunks=chunks)
    return out if capacity is not None else (out, jnp.zeros((), jnp.int32))
  def f(x, ids, weights, params):
    y, dropped = local(x, ids, weights, params)
    return y, dropped[None]
  if mode == "checkpoint":
    f = jax.checkpoint(f)
  return jax.shard_map(f, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                       out_specs=(P("i"), P("i")))


def _values_and_grads(f, ids, dy):
  """jit of (y, aux, (dx, dweights, dparams)) for cotangent dy, one compile."""
  def run(x, weights, params):
    y, pull, aux = jax.vjp(lambda x, w, p: f(x, ids, w, p), x, weights,
                           params, has_aux=True)
    return y, aux, pull(dy)
  return jax.jit(run)


def _assert_close(got, want, rtol=2e-5, atol=2e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                               atol=atol)


def _case_params():
  for case in CASES:
    marks = []
    if not NEWEST and case not in OLDER_JAX_CASES:
      marks.append(pytest.mark.skip(reason="all cases on jax 0.12 only; "
                                    "OLDER_JAX_CASES here (CI budget)"))
    yield pytest.param(*case, marks=marks,
                       id="n{}-el{}-k{}-c{}-{}-{}".format(*case))


@pytest.mark.parametrize("n, experts_local, k, chunks, capacity, mode",
                         list(_case_params()))
def test_values_drops_and_grads_equal_the_dense_reference(
    n, experts_local, k, chunks, capacity, mode):
  x, ids, weights, params = _inputs(n, experts_local, k)
  cap = _capacity(capacity, k)
  kept, dropped = kept_by_the_rule(ids, n, cap)
  if capacity == "tight":
    assert dropped.sum() > 0, "the tight case must drop something"
  if capacity == "large":
    assert dropped.sum() == 0
  dy = jax.random.normal(jax.random.key(9), x.shape)

  (y, got_dropped, grads) = _values_and_grads(
      ours(n, chunks, cap, mode), ids, dy)(x, weights, params)
  ref = dense_reference(jnp.asarray(kept, jnp.float32))
  want_y, _, want_grads = _values_and_grads(
      lambda *a: (ref(*a), None), ids, dy)(x, weights, params)
  np.testing.assert_array_equal(np.asarray(got_dropped), dropped)
  _assert_close(y, want_y)
  _assert_close(grads, want_grads, rtol=1e-4, atol=1e-4)
