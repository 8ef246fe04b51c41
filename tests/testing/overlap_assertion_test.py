"""`jax_overlap.testing` without the real compilers: targets, limits, what a
failure says, and the error that names what to install
(the real compilers: tests/aot/testing_compiled_test.py)."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import pytest

import jax_overlap
from jax_overlap import OverlapReport, testing
from jax_overlap._src.testing import assertion, targets

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"


@pytest.fixture
def no_compilers(monkeypatch):
  """As on a machine where neither libtpu nor the CUDA plugin is installed."""
  monkeypatch.setattr(targets, "_found", lambda module: False)
  targets._topology.cache_clear()
  yield
  targets._topology.cache_clear()


def test_the_public_names():
  assert testing.assert_overlapped is assertion.assert_overlapped
  assert jax_overlap.errors.CompilerNotFoundError is testing.CompilerNotFoundError
  assert issubclass(testing.CompilerNotFoundError, RuntimeError)
  assert sorted(testing.TARGETS) == ["gpu-a100", "gpu-h100", "tpu-v5e", "tpu-v5p"]


@pytest.mark.parametrize("target, install", [
    ("tpu-v5e", "`pip install libtpu`"),
    ("tpu-v5p", "`pip install libtpu`"),
    ("gpu-h100", "`pip install jax-cuda12-plugin=="),
    ("gpu-a100", "nvidia-cuda-nvcc-cu12`"),
])
def test_a_missing_compiler_says_what_to_install(no_compilers, target, install):
  with pytest.raises(testing.CompilerNotFoundError) as info:
    testing.assert_overlapped(lambda x: x, jnp.ones(8), target=target,
                              max_exposed=0)
  assert f"target {target!r}" in str(info.value)
  assert install in str(info.value)
  with pytest.raises(testing.CompilerNotFoundError, match=install[:12]):
    testing.target_mesh(target, (8,), ("d",))


def test_targets_by_name_and_topology():
  assert targets.resolve_target("TPU v5e").topology == "v5e:2x4"
  t = targets.resolve_target("gpu_h100:1x2x8")
  assert (t.name, t.topology, t.profile) == ("gpu-h100", "1x2x8", "h100")
  with pytest.raises(ValueError, match=r"target='b200' is not a known target; "
                                       r"the targets are tpu-v5e, tpu-v5p"):
    testing.assert_overlapped(lambda x: x, jnp.ones(8), target="b200",
                              max_exposed=0)


@pytest.mark.parametrize("limits, error, message", [
    ({}, TypeError, "needs a limit: max_exposed"),
    ({"max_exposed": -1.0}, ValueError, r"max_exposed=...\) must be a number >= 0"),
    ({"max_exposed_fraction": "10%"}, ValueError,
     r"max_exposed_fraction=...\) must be a number >= 0 \(or None\), got '10%'"),
])
def test_limits_are_checked_first(no_compilers, limits, error, message):
  with pytest.raises(error, match=message):
    testing.assert_overlapped(lambda x: x, jnp.ones(8), **limits)


def _report():
  # gpu_prefetch.txt: an all-gather with the matmul in its window (hidden)
  # and a blocking all-reduce with nothing beside it (exposed).
  return OverlapReport.from_hlo(FIXTURES / "gpu_prefetch.txt", hardware="h100")


def test_a_collective_over_its_limit_fails_with_its_rows():
  report = _report()
  gather, reduce = report.collectives
  assert gather.exposed_s == 0 < reduce.exposed_s == reduce.comm_s
  t = targets.resolve_target("gpu-h100")
  assertion._check(report, t, None, 1.0, "step")   # none exposes more than all
  with pytest.raises(AssertionError) as info:
    assertion._check(report, t, None, 0.5, "step")
  text = str(info.value)
  assert text.startswith("assert_overlapped(step) on gpu-h100 (1x1x8), "
                         "modelled on h100: 1 of 2 collectives expose more "
                         "than allowed:")
  assert "#2 all-reduce all-reduce-start -> all-reduce-done" in text
  assert "(over max_exposed_fraction=0.5)" in text
  assert "at train.py:34" in text           # the row's source line
  assert "What to change:" in text          # the report's hints
  assert "all-gather-start" not in text
  with pytest.raises(AssertionError, match=r"over max_exposed=1e-06 s"):
    assertion._check(report, t, 1e-6, None, "step")
  assertion._check(report, t, reduce.exposed_s, None, "step")


def test_a_program_without_collectives_fails():
  report = OverlapReport.from_hlo('''HloModule m, is_scheduled=true
ENTRY %main (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}''')
  with pytest.raises(AssertionError, match="has no collective, so nothing to "
                                           "overlap"):
    assertion._check(report, targets.resolve_target("tpu-v5e"), 0.0, None,
                     "step")


def test_the_gpu_target_configs_ship_with_their_licence():
  specs = targets.SPECS
  for name in ("NVIDIA_H100_80GB_HBM3.txtpb", "NVIDIA_A100_SXM4_80GB.txtpb"):
    text = (specs / name).read_text()
    assert "Copyright 2024 The OpenXLA Authors." in text
    assert "Licensed under the Apache License, Version 2.0" in text
  modified = (specs / "NVIDIA_H100_80GB_HBM3.jax0.10.2.txtpb").read_text()
  assert "Modified by jax-overlap" in modified
  assert targets.gpu_configs("NVIDIA_H100_80GB_HBM3.txtpb") == [
      specs / "NVIDIA_H100_80GB_HBM3.txtpb",
      specs / "NVIDIA_H100_80GB_HBM3.jax0.10.2.txtpb"]
