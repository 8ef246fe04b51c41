"""Programs run both across two processes and in one (multiprocess_test.py).

`run_all()` builds each program on an 8-device mesh with axis "i" (one
process's 8, or two processes' 4 each), runs it on inputs made the same way
everywhere, and returns its results as full numpy arrays. Everything runs
inside `jax.set_mesh`, as a user would write it, and the first jax_overlap
call is an ordered program compiled there on an Explicit mesh (issue 15,
defect 1: that first compile failed on jax 0.10.2 and 0.11.0).
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from value_and_grads import with_grads

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

PERM = [(k, (k + 1) % 8) for k in range(8)]


def _to_host(x):
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # noqa: PLC0415
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _put(mesh, array: np.ndarray, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def _futures(mesh):
  """Each of the five futures in an ordered block, value and gradient."""
  cases = {
      "all_gather": (lambda v: jo.all_gather_start(v, "i", tiled=True), P("i")),
      "psum": (lambda v: jo.psum_start(v, "i"), P()),
      "psum_scatter": (lambda v: jo.psum_scatter_start(v, "i", tiled=True), P("i")),
      "all_to_all": (lambda v: jo.all_to_all_start(v, "i", 0, 0, tiled=True), P("i")),
      "ppermute": (lambda v: jo.ppermute_start(v, "i", PERM), P("i")),
  }
  x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 100.0
  out = {}
  for name, (start, out_spec) in cases.items():
    @jax.shard_map(mesh=mesh, in_specs=P("i"), out_specs=(out_spec, P("i")))
    def body(v, start=start):
      @jo.program_order(enforce=True)
      def ordered(v):
        fut = start(v)
        side = jnp.tanh(v @ v.T) @ v      # written while the collective runs
        y = fut.done()
        return y * jnp.cos(y), side
      return ordered(v)
    loss = lambda out: sum(jnp.sum(t ** 2) for t in out)
    value, grad = with_grads(body, loss)(_put(mesh, x, P("i")))
    out[f"{name}/value"] = _to_host(value[0])
    out[f"{name}/grad"] = _to_host(grad)
  return out


def _fsdp(mesh):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 16)).astype(np.float32)
  w1 = (rng.normal(size=(3, 16, 24)) * 0.3).astype(np.float32)
  w2 = (rng.normal(size=(3, 24, 16)) * 0.3).astype(np.float32)
  layer = lambda h, w: h + jnp.tanh(h @ w["w1"]) @ w["w2"]
  specs = {"w1": P(None, "i"), "w2": P(None, "i")}

  @jax.shard_map(mesh=mesh, in_specs=(P("i"), specs), out_specs=P())
  def loss(x, params):
    return lax.psum(jnp.sum(jo.fsdp_scan(layer, x, params, axis="i") ** 2), "i")
  params = {"w1": _put(mesh, w1, specs["w1"]), "w2": _put(mesh, w2, specs["w2"])}
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      _put(mesh, x, P("i")), params)
  return {"fsdp/loss": _to_host(value), "fsdp/grad_x": _to_host(grads[0]),
          "fsdp/grad_w1": _to_host(grads[1]["w1"]),
          "fsdp/grad_w2": _to_host(grads[1]["w2"])}


def _collective_matmul(mesh):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  w = rng.normal(size=(16, 32)).astype(np.float32)
  out = {}
  for name, fn, out_spec in (
      ("all_gather_matmul", lambda x, w: jo.all_gather_matmul(x, w, "i"), P()),
      ("matmul_reduce_scatter",
       lambda x, w: jo.matmul_reduce_scatter(x, w, "i"), P("i")),
  ):
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P()), out_specs=out_spec,
                      check_vma=False)
    args = (_put(mesh, x, P("i")), _put(mesh, w, P()))
    value, (gx, gw) = with_grads(f, lambda out: jnp.sum(jnp.sin(out)),
                                  (0, 1))(*args)
    out[f"{name}/value"] = _to_host(value)
    out[f"{name}/grad_x"] = _to_host(gx)
    out[f"{name}/grad_w"] = _to_host(gw)
  return out


def _ordered_program(mesh):
  """An ordered program outside shard_map, on arrays sharded over the mesh."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(32, 8)).astype(np.float32)
  w = rng.normal(size=(8, 8)).astype(np.float32)

  @jo.program_order(enforce=True)
  def f(x, w):
    a = jnp.sin(x * 2.0)
    return jnp.tanh(a @ w) * x + a
  args = _put(mesh, x, P("i")), _put(mesh, w, P())
  value, (gx, gw) = with_grads(f, lambda out: jnp.sum(out ** 2), (0, 1))(*args)
  return {"ordered/value": _to_host(value), "ordered/grad_x": _to_host(gx),
          "ordered/grad_w": _to_host(gw)}


def _fsdp_explicit(mesh):
  """`fsdp_scan` outside shard_map on an Explicit mesh (the `_fsdp` model)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 16)).astype(np.float32)
  w1 = (rng.normal(size=(3, 16, 24)) * 0.3).astype(np.float32)
  w2 = (rng.normal(size=(3, 24, 16)) * 0.3).astype(np.float32)
  layer = lambda h, w: h + jnp.tanh(h @ w["w1"]) @ w["w2"]
  loss = lambda x, params: jnp.sum(jo.fsdp_scan(layer, x, params, axis="i") ** 2)
  params = {"w1": _put(mesh, w1, P(None, "i")), "w2": _put(mesh, w2, P(None, "i"))}
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      _put(mesh, x, P("i")), params)
  return {"fsdp_explicit/loss": _to_host(value),
          "fsdp_explicit/grad_x": _to_host(grads[0]),
          "fsdp_explicit/grad_w1": _to_host(grads[1]["w1"]),
          "fsdp_explicit/grad_w2": _to_host(grads[1]["w2"])}


def _mesh(kind):
  return jax.make_mesh((8,), ("i",), axis_types=(kind,))


def run_all() -> dict[str, np.ndarray]:
  results = {}
  explicit = _mesh(jax.sharding.AxisType.Explicit)
  with jax.set_mesh(explicit):
    for part in (_ordered_program, _fsdp_explicit):   # the first calls
      results.update(part(explicit))
  auto = _mesh(jax.sharding.AxisType.Auto)
  with jax.set_mesh(auto):
    for part in (_futures, _fsdp, _collective_matmul):
      results.update(part(auto))
  return results


def run_llama_4d(plan_name: str = "pp_fsdp_tp") -> dict[str, np.ndarray]:
  """examples/llama_4d.py's plan `plan_name` (pp x fsdp x tp) on the 8
  devices in mesh order, so that across two processes 'pp' splits them
  (stage 0 on process 0's devices): its loss and every gradient, by leaf
  path."""
  sys.path.insert(0, str(EXAMPLES))
  import llama_4d  # noqa: PLC0415
  plan = llama_4d.PLANS[plan_name]
  mesh = plan.mesh
  if jax.process_count() == 2:
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
    assert (owners == np.arange(2)[:, None, None]).all(), owners
  cfg = llama_4d.config_for(plan)
  params = jax.tree.map(np.asarray, llama_4d.init(cfg, jax.random.key(0)))
  tokens, targets = (np.asarray(a) for a in llama_4d.batch(
      cfg, jax.random.key(1), llama_4d.batch_size(plan), 16))
  placed = jax.tree.map(lambda a, s: _put(mesh, np.asarray(a), s),
                        plan.stage(params), plan.specs(params))
  batch = [_put(mesh, a, plan.batch_spec()) for a in (tokens, targets)]
  with jax.default_matmul_precision("highest"):
    loss, grads = jax.jit(jax.value_and_grad(plan.loss))(placed, *batch)
  return _llama_4d_results(loss, plan.unstage(jax.tree.map(_to_host, grads)))


def single_program_llama_4d(plan_name: str) -> dict[str, np.ndarray]:
  """What `run_llama_4d(plan_name)` returns, from examples/llama_4d.py's
  model as one program on one device (the same parameters and batch): the
  reference, as in tests/patterns/pipeline/llama_4d_test.py. Plans of one
  model and batch size share it (one compile)."""
  sys.path.insert(0, str(EXAMPLES))
  import llama_4d  # noqa: PLC0415
  plan = llama_4d.PLANS[plan_name]
  return _single_program_llama_4d(llama_4d.config_for(plan), llama_4d.batch_size(plan))


@functools.cache
def _single_program_llama_4d(cfg, rows: int) -> dict[str, np.ndarray]:
  import llama_4d  # noqa: PLC0415
  params = llama_4d.init(cfg, jax.random.key(0))
  tokens, targets = llama_4d.batch(cfg, jax.random.key(1), rows, 16)
  with jax.default_matmul_precision("highest"):
    loss, grads = jax.jit(jax.value_and_grad(llama_4d.loss))(params, tokens,
                                                             targets)
  return _llama_4d_results(_to_host(loss), jax.tree.map(_to_host, grads))


def _llama_4d_results(loss, grads) -> dict[str, np.ndarray]:
  """The loss and each gradient leaf (in the model's layout) by path."""
  out = {"llama_4d/loss": np.asarray(loss)}
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    out["llama_4d/grad" + jax.tree_util.keystr(path)] = np.asarray(g)
  return out


def llama_4d_leaves(plan_name: str) -> int:
  """How many parameter leaves plan `plan_name`'s model has (an MoE block
  has a router and experts where a dense one has its MLP)."""
  sys.path.insert(0, str(EXAMPLES))
  import llama_4d  # noqa: PLC0415
  cfg = llama_4d.config_for(llama_4d.PLANS[plan_name])
  return len(jax.tree.leaves(jax.eval_shape(
      lambda k: llama_4d.init(cfg, k), jax.random.key(0))))


def run_llama_4d_psum() -> dict[str, np.ndarray]:
  """`run_llama_4d` of the pp x dp x tp plan (matmul_psum over 'tp')."""
  return run_llama_4d("pp_dp_tp")


def run_llama_4d_ring() -> dict[str, np.ndarray]:
  """`run_llama_4d` of the pp x fsdp x cp plan (ring attention over 'cp')."""
  return run_llama_4d("pp_fsdp_cp")


def run_llama_4d_experts() -> dict[str, np.ndarray]:
  """`run_llama_4d` of the pp x fsdp x ep plan (expert_parallel over 'ep')."""
  return run_llama_4d("pp_fsdp_ep")
