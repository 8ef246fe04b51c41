"""`fsdp_scan` on an explicit mesh where its moves stay `jax.reshard`s
(patterns/fsdp/arguments.py `_say_explicit_mesh_is_not_prefetched`): for a
TPU the user is told once, with what to do; CPU and GPU stay silent (GPU ties
the reshards into their step; CPU blocks anyway). The platform is forced
here; what the TPU compilers make of the reshards is in docs/compilers.md."""

from __future__ import annotations

import warnings

import pytest

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async
from jax_overlap._src.patterns.fsdp import arguments


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
  monkeypatch.setattr(not_async, "_warned", set())


@pytest.mark.parametrize("kind", ["TPU v4", None])
def test_tpu_reshards_are_said_once_with_the_way_out(monkeypatch, kind):
  monkeypatch.setattr(_compat, "trace_device", lambda: ("tpu", kind))
  with pytest.warns(jo.CollectiveNotAsyncWarning) as caught:
    arguments._say_explicit_mesh_is_not_prefetched()
    arguments._say_explicit_mesh_is_not_prefetched()
  assert len(caught) == 1, [str(w.message) for w in caught]
  message = str(caught[0].message)
  assert "fsdp_scan on an explicit mesh, for tpu" in message, message
  assert "inside jax.shard_map" in message, message
  assert (kind or "this generation") in message or not _compat.ASYNC_CUSTOM_CALLS


@pytest.mark.parametrize("platform", ["cpu", "cuda", None])
def test_other_platforms_are_not_told(monkeypatch, platform):
  monkeypatch.setattr(_compat, "trace_device", lambda: (platform, None))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    arguments._say_explicit_mesh_is_not_prefetched()
