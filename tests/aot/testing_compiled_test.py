"""`jax_overlap.testing.assert_overlapped` on the real compilers, ahead of
time: a future with the matmul in its window passes on TPU v5e, v5p, H100
and A100, a gather its matmul waits for fails with its row, a function
built on `target_mesh` compiles, and docs/overlap-report.md's pytest example
passes under pytest as written."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest
from compilers import P

import jax_overlap
from jax_overlap.testing import assert_overlapped, target_mesh

pytestmark = pytest.mark.newest_jax(older_jax=["*"])
ROOT = pathlib.Path(__file__).parents[2]
TARGETS = ["tpu-v5e", "tpu-v5p", "gpu-h100", "gpu-a100"]
_NEEDS = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}


def _needs(target):
  from jax_overlap._src.testing import targets  # noqa: PLC0415
  why = targets.missing(targets.resolve_target(target).platform)
  if why:
    pytest.skip(f"{target}: {why}")


def _cpu_args():
  """The arguments as a user's CI has them: over 8 CPU devices."""
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:8], ("d",))
  w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P("d")))
  x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P()))
  return w, x


def _prefetching(mesh=None):
  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
  @jax_overlap.program_order(enforce=True)
  def layer(w_shard, x):
    w = jax_overlap.all_gather_start(w_shard, "d", tiled=True)
    h = jnp.tanh(jnp.tanh(x @ x) @ x)
    return (h @ w.done())[:256]
  return layer


def _waiting():
  @jax.shard_map(in_specs=(P("d"), P()), out_specs=P("d"))
  def layer(w_shard, x):
    return jnp.tanh(x @ jax.lax.all_gather(w_shard, "d", tiled=True))[:256]
  return layer


@pytest.mark.parametrize("target", TARGETS)
def test_a_future_behind_its_matmul_passes(target):
  _needs(target)
  if len(jax.devices("cpu")) < 8:
    pytest.skip("needs 8 CPU devices")
  report = assert_overlapped(_prefetching(), *_cpu_args(), target=target,
                             max_exposed_fraction=0.1)
  assert report.collectives
  assert all(c.exposed_s <= 0.1 * c.comm_s for c in report.collectives)
  assert target.split("-")[1] in report.hardware.name


@pytest.mark.parametrize("target", TARGETS)
def test_a_gather_its_matmul_waits_for_fails_with_its_row(target):
  _needs(target)
  if len(jax.devices("cpu")) < 8:
    pytest.skip("needs 8 CPU devices")
  with pytest.raises(AssertionError) as info:
    assert_overlapped(_waiting(), *_cpu_args(), target=target,
                      max_exposed_fraction=0.1)
  text = str(info.value)
  assert f"on {target} (" in text and "expose more than allowed" in text
  assert re.search(r"1\. #\d+ all-gather \S+ -> \S+: exposed", text), text
  assert "testing_compiled_test.py" in text      # the source line


@pytest.mark.parametrize("target", ["tpu-v5e", "gpu-h100"])
def test_a_function_built_on_the_target_mesh(target):
  _needs(target)
  mesh = target_mesh(target, (8,), ("d",))
  w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P("d")))
  x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32,
                           sharding=jax.NamedSharding(mesh, P()))
  report = assert_overlapped(_prefetching(mesh), w, x, target=target,
                             max_exposed=1e-6)
  assert [c.kind for c in report.collectives][:1] in (
      ["all-gather"], ["collective-permute"])


def _docs_example() -> str:
  text = (ROOT / "docs" / "overlap-report.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  (block,) = [b for b in blocks if b.startswith("# test_overlap.py")]
  return block


def test_the_docs_example_passes_under_pytest(tmp_path):
  _needs("tpu-v5e")
  (tmp_path / "test_overlap.py").write_text(_docs_example())
  (tmp_path / "conftest.py").write_text(
      "import os\nos.environ['JAX_PLATFORMS'] = 'cpu'\n"
      "import jax\njax.config.update('jax_num_cpu_devices', 8)\n")
  env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
  env.pop("XLA_FLAGS", None)
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "test_overlap.py"], cwd=tmp_path, env=env, capture_output=True,
      text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "2 passed" in run.stdout, run.stdout[-2000:]
