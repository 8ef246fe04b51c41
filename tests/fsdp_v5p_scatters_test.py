"""fsdp_scan(bucket=False) where reduce-scatters are permute futures (TPU v5p)
says that some lose their overlap and that bucket=True keeps it.

The forms are forced on CPU (`permute_forms.FORCE`); the measured shortfall
and the warning on a real v5p compile are in tests/aot/real_compilers_test.py
(test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters)."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async, permute_forms
from jax_overlap._src.patterns.fsdp import v5p_scatters

N = 8


@pytest.fixture(scope="module")
def mesh():
  kwargs = {}
  if hasattr(jax.sharding, "AxisType"):
    kwargs["axis_types"] = (jax.sharding.AxisType.Auto,)
  return jax.make_mesh((N,), ("x",), **kwargs)


def _said(mesh, names, bucket, force=True, monkeypatch=None):
  """The CollectiveNotAsyncWarning messages of tracing value_and_grad of an
  fsdp_scan over 3 layers of `names` weights."""
  monkeypatch.setattr(permute_forms, "FORCE", force)

  def layer(x, p):
    for k in names:
      x = jnp.tanh(x @ p[k])
    return x

  def loss(x, ps):
    return jo.fsdp_scan(layer, x, ps, axis="x", bucket=bucket).sum()[None]
  spec = {k: P(None, "x") for k in names}
  fwd = jax.shard_map(loss, mesh=mesh, in_specs=(P("x"), spec), out_specs=P("x"))
  f = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
  w = jnp.ones((3, 16, 16))
  not_async._warned.clear()   # said once per process
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(f).lower(jnp.ones((64, 16)), {k: w for k in names})
  return [str(w.message) for w in caught
          if issubclass(w.category, jo.CollectiveNotAsyncWarning)]


needs_futures = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU (said "
           "there already), so the v5p permutes' shortfall is not said")


@needs_futures
def test_unbucketed_permute_scatters_are_said(mesh, monkeypatch):
  said = _said(mesh, "ab", False, monkeypatch=monkeypatch)
  assert said == [v5p_scatters.MESSAGE], said
  assert "bucket=True" in said[0] and "4 of the 6" in said[0]


def test_buckets_are_not_said(mesh, monkeypatch):
  assert _said(mesh, "ab", True, monkeypatch=monkeypatch) == []


def test_one_weight_a_layer_is_not_said(mesh, monkeypatch):
  # The same program with or without buckets: nothing to suggest.
  assert _said(mesh, "a", False, monkeypatch=monkeypatch) == []


def test_not_said_where_scatters_are_not_permutes(mesh, monkeypatch):
  assert _said(mesh, "ab", False, force=False, monkeypatch=monkeypatch) == []


@pytest.mark.skipif(_compat.ASYNC_CUSTOM_CALLS, reason="jax >= 0.12 says it")
def test_older_jax_does_not_say_it(mesh, monkeypatch):
  said = _said(mesh, "ab", False, monkeypatch=monkeypatch)
  assert v5p_scatters.MESSAGE not in said, said
