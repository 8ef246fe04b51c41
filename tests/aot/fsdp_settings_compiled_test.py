"""fsdp_scan's settings (issue: "FSDP as its users tune it") compiled for
the real compilers, inside shard_map, one training step each: bfloat16
gathers with float32 reduce-scatters, per-layer inputs (`xs`), hybrid
sharding (`replica_axis`). Each keeps its windows: every gather but the
forward pass's first has a matmul in flight, every reduce-scatter but the
last (GPU; on TPU their form, an all-to-all, one in flight at a time, every
one but the last) too, and the named dtypes are what travels.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_overlap
import schedule
from compilers import compiled_text, target
from jax_overlap._src.collectives import not_async
from real_compilers_test import OLDER

pytestmark = pytest.mark.skipif(
    OLDER, reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

LAYERS = 4


def _layer(x, p, *xs):
  h = jnp.tanh(x @ p["a"].astype(x.dtype))
  if xs:
    h = h * xs[0]
  return jnp.tanh(h @ p["b"].astype(x.dtype))


def _program(t, setting):
  axes, mesh = ("x",), t.mesh
  kw, extra, extra_spec = {}, (), ()
  if setting == "mixed":
    kw = dict(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  elif setting == "xs":
    extra, extra_spec = (jax.ShapeDtypeStruct(
        (LAYERS,), jnp.float32, sharding=NamedSharding(mesh, P())),), (P(),)
  elif setting == "hsdp":
    mesh = Mesh(np.array(t.mesh.devices).reshape(2, t.n // 2), ("replica", "x"))
    axes = ("replica", "x")
    kw = dict(replica_axis="replica")

  def loss(x, ps, *xs):
    y = jax_overlap.fsdp_scan(_layer, x, ps, axis="x",
                              xs=xs[0] if xs else None, **kw)
    return y.astype(jnp.float32).sum()[None]

  spec = {"a": P(None, "x"), "b": P(None, "x")}
  fwd = jax.shard_map(loss, mesh=mesh, in_specs=(P(axes), spec, *extra_spec),
                      out_specs=P(axes))
  f = jax.value_and_grad(lambda *a: fwd(*a).sum(), argnums=1)
  w = jax.ShapeDtypeStruct((LAYERS, 16, 16), jnp.float32,
                           sharding=NamedSharding(mesh, spec["a"]))
  x = jax.ShapeDtypeStruct((64, 16), jnp.float32,
                           sharding=NamedSharding(mesh, P(axes)))
  return f, (x, {"a": w, "b": w}, *extra)


@functools.cache
def _compiled(name, setting):
  t = target(name)
  not_async._warned.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn, args = _program(t, setting)
    text = compiled_text(fn, *args)
  return text, tuple(str(w.message) for w in caught
                     if issubclass(w.category, not_async.CollectiveNotAsyncWarning))


def _windows(text, kind):
  """The windows of `kind`, each as many times as it runs (fsdp_scan's
  loops hold one layer an iteration: a loop body's window runs once a
  layer)."""
  return schedule.runs(text, [w for w in schedule.windows(text)
                              if w.kind == kind])


def _ops(text, opcode):
  """The scheduled lines whose instruction is `opcode`."""
  return [line for line in text.splitlines() if f" {opcode}(" in line]


@pytest.mark.parametrize("setting", ["mixed", "xs", "hsdp"])
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_fsdp_setting_compiles_with_its_windows(name, setting):
  text, warned = _compiled(name, setting)
  gpu = name.startswith("gpu")
  gathers = _windows(text, "all-gather")
  # Forward: LAYERS gathers (layer 0's split in two groups by use order);
  # backward: the regathers of all but the kept last layer.
  assert len(gathers) >= 2 * LAYERS - 1, gathers
  assert sum(w.matmuls == 0 for w in gathers) <= 1, gathers
  scatters = _windows(text, "reduce-scatter" if gpu else "all-to-all")
  assert len(scatters) >= LAYERS - 1, scatters
  # (TPU HSDP: the replicas' all-reduces take the all-to-all form too, and
  # run synchronously beside the reduce-scatters' forms: see below.)
  overlapped = LAYERS - 1 if setting == "hsdp" and not gpu else len(scatters) - 1
  assert sum(w.matmuls >= 1 for w in scatters) >= overlapped, scatters
  if setting == "mixed":
    # What travels: bfloat16 gathers, float32 reduce-scatters.
    starts = _ops(text, "all-gather-start")
    assert starts and all("bf16[" in s and "f32[" not in s for s in starts), \
        starts
    moved = _ops(text, "reduce-scatter-start" if gpu else "all-to-all-start")
    assert moved and all("f32[" in s and "bf16[" not in s for s in moved), moved
  if setting == "hsdp":
    if gpu:
      # Each layer's gradient all-reduced over the replicas is in flight
      # across the next layer's backward (all but the last layer's).
      reduces = _windows(text, "all-reduce")
      assert sum(w.matmuls >= 1 for w in reduces) >= LAYERS - 1, reduces
      assert not warned, warned
    else:
      # TPU: psum_start's form is an all-to-all too, and libtpu allows one
      # in flight: the replica all-reduces run synchronously, and it is said.
      assert any("psum_start on tpu" in m for m in warned), warned
  else:
    assert not warned, warned
