"""The pipeline composed with a second mesh axis: every parameter's gradient
equals the sequential model's, for leaves sharded and replicated over it.

Each case has a stage parameter replicated over the non-pipeline axis (a norm
scale, a bias, an FSDP leaf left unsharded): before the fix its gradient came
out times that axis's size while the loss and the input gradient were right.
Each case runs every schedule (2 devices on 'pp'; interleaved, ZB-V and
DualPipeV with 2 chunks a device, 4 stages); on older jax a subset in which
every schedule meets at least one second axis.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.attention.ring import ring_attention
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention
from jax_overlap._src.patterns.collective_matmul import (all_gather_matmul,
                                                        matmul_reduce_scatter)
from jax_overlap._src.patterns.fsdp.scan import fsdp_scan
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

D, F, M = 4, 8, 4
#: (schedule, virtual_stages): every schedule pipeline_loss runs.
SCHEDULES = {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "interleaved": 2, "zb-v": 2,
             "dualpipev": 2}
each_schedule = pytest.mark.parametrize("schedule", list(SCHEDULES))

pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_pp_by_dp_replicated_weights[1f1b]",
    "test_pp_by_dp_replicated_weights[zb-h1]",
    "test_pp_by_tp_with_a_norm_scale[1f1b]",
    "test_pp_by_tp_with_a_norm_scale[gpipe]",
    "test_pp_by_fsdp_with_a_replicated_leaf[1f1b]",
    "test_pp_by_fsdp_with_a_replicated_leaf[interleaved]",
    "test_ulysses_inside_a_stage[1f1b]",
    "test_ulysses_inside_a_stage[zb-v]",
    "test_ring_attention_inside_a_stage[1f1b]",
    "test_ring_attention_inside_a_stage[dualpipev]",
    "test_collective_matmul_inside_a_stage[zb-h1]",
    "test_a_plain_ppermute_inside_a_stage[1f1b]",
    "test_switch_dispatch_with_a_collective_is_refused"])
TOL = dict(rtol=1e-5, atol=1e-6)


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _mesh(p, n, name):
  return jax.make_mesh((p, n), ("pp", name),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:p * n])


def _sequential(stage):
  def loss(w, xs, ts):
    stages = jax.tree.leaves(w)[0].shape[0]

    def one(x, t):
      for g in range(stages):
        x = stage(jax.tree.map(lambda a: a[g], w), x)
      return mse(x, t)
    return jnp.mean(jax.vmap(one)(xs, ts))
  return loss


def _pipelined(stage, mesh, w_specs, x_spec, mean_over, schedule="1f1b",
               **kw):
  p = mesh.shape["pp"]

  def body(w, xs, ts):
    loss = pipeline_loss(stage, mse, w, xs, ts, axis="pp", schedule=schedule,
                         virtual_stages=SCHEDULES[schedule], **kw)
    return jax.lax.pmean(loss, mean_over)

  def loss(w, xs, ts):
    laid = pipeline_stage_layout(w, p, schedule=schedule)
    return jax.shard_map(body, mesh=mesh, in_specs=(w_specs, x_spec, x_spec),
                         out_specs=P())(laid, xs, ts)
  return loss


def _stages(schedule, p=2):
  """How many stages a schedule's model has on p devices."""
  return p * SCHEDULES[schedule]


def _check(loss, ref, w, xs, ts):
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, xs, ts)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(w, xs, ts)
  np.testing.assert_allclose(got[0], want[0], **TOL)
  for path, a in jax.tree_util.tree_leaves_with_path(got[1]):
    b = want[1]
    for k in path:
      b = b[k.key if hasattr(k, "key") else k.idx]
    # and within rtol of the leaf's largest entry: float32 sums in another
    # order through 4 attention stages (grads reach ~10) differ by ~2e-6 of it
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=TOL["rtol"], atol=TOL["rtol"] * scale,
                               err_msg=jax.tree_util.keystr(path))


def _data(p, batch=4, seq=None, **shapes):
  keys = jax.random.split(jax.random.key(0), len(shapes) + 2)
  w = {name: (1.0 if name.startswith("scale") else 0.0)
       + jax.random.normal(k, (p,) + shape) / 2
       for (name, shape), k in zip(sorted(shapes.items()), keys)}
  inner = (batch, D) if seq is None else (batch, seq, D)
  xs = jax.random.normal(keys[-2], (M,) + inner)
  ts = jax.random.normal(keys[-1], (M,) + inner)
  return w, xs, ts


@each_schedule
def test_pp_by_dp_replicated_weights(schedule):
  """docs/pipeline.md's memory-table setup: weights replicated over 'dp',
  the batch sharded over it, the loss pmean'ed over it."""
  def stage(w, x):
    return jnp.tanh(x @ w["w"] + w["b"])
  w, xs, ts = _data(_stages(schedule), w=(D, D), b=(D,))
  loss = _pipelined(stage, _mesh(2, 2, "dp"), P("pp"), P(None, "dp"), "dp",
                    schedule=schedule)
  _check(loss, _sequential(stage), w, xs, ts)


@each_schedule
def test_pp_by_tp_with_a_norm_scale(schedule):
  """The documented psum pattern plus a scale replicated over 'tp'."""
  def stage(w, x):
    h = x * w["scale"] * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jax.lax.psum(jnp.tanh(h @ w["up"]) @ w["down"], "tp")

  def reference(w, x):
    h = x * w["scale"] * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jnp.tanh(h @ w["up"]) @ w["down"]
  w, xs, ts = _data(_stages(schedule), scale=(D,), up=(D, F), down=(F, D))
  specs = {"scale": P("pp"), "up": P("pp", None, "tp"), "down": P("pp", "tp", None)}
  loss = _pipelined(stage, _mesh(2, 2, "tp"), specs, P(), "tp", schedule=schedule)
  _check(loss, _sequential(reference), w, xs, ts)


@each_schedule
def test_pp_by_fsdp_with_a_replicated_leaf(schedule):
  """`shard_dims=None` leaves a leaf whole on every FSDP device."""
  def layer(x, w):
    return jnp.tanh(x @ w["w"] + w["b"])

  def stage(w, x):   # w["w"]: [2 layers, D/fsdp, D]; w["b"]: [2 layers, D], whole
    return fsdp_scan(layer, x, w, axis="fsdp", shard_dims={"w": 1, "b": None})

  def reference(w, x):
    for i in range(2):
      x = layer(x, jax.tree.map(lambda a: a[i], w))
    return x
  w, xs, ts = _data(_stages(schedule), w=(2, D, D), b=(2, D))
  specs = {"w": P("pp", None, "fsdp", None), "b": P("pp")}
  loss = _pipelined(stage, _mesh(2, 2, "fsdp"), specs, P(None, "fsdp"), "fsdp",
                    schedule=schedule)
  _check(loss, _sequential(reference), w, xs, ts)


def _attention_stage(attend):
  """A stage with one attention over the sequence (heads = 2, head dim 2) and
  a norm scale replicated over the context axis."""
  def stage(w, x):   # x: (batch, seq_local, D)
    b, s, _ = x.shape
    h = x * w["scale"]
    q, k, v = (jnp.reshape(h @ w[n], (b, s, 2, D // 2)) for n in ("q", "k", "v"))
    return x + jnp.reshape(attend(q, k, v), (b, s, D))
  return stage


def _dense(q, k, v):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


@each_schedule
def test_ulysses_inside_a_stage(schedule):
  stage = _attention_stage(lambda q, k, v: ulysses_attention(q, k, v, axis="cp"))
  w, xs, ts = _data(_stages(schedule), batch=2, seq=4, scale=(D,), q=(D, D), k=(D, D), v=(D, D))
  loss = _pipelined(stage, _mesh(2, 2, "cp"), P("pp"), P(None, None, "cp"), "cp",
                    schedule=schedule)
  _check(loss, _sequential(_attention_stage(_dense)), w, xs, ts)


# --- a collective-permute inside a stage (lockstep dispatch) ----------------
# Before lockstep dispatch each of these aborted the process: XLA:CPU's
# rendezvous waited 40 s for devices that had taken another switch branch.

@each_schedule
def test_ring_attention_inside_a_stage(schedule):
  stage = _attention_stage(lambda q, k, v: ring_attention(q, k, v, axis="cp"))
  w, xs, ts = _data(_stages(schedule), batch=2, seq=4, scale=(D,), q=(D, D), k=(D, D), v=(D, D))
  loss = _pipelined(stage, _mesh(2, 2, "cp"), P("pp"), P(None, None, "cp"), "cp",
                    schedule=schedule)
  _check(loss, _sequential(_attention_stage(_dense)), w, xs, ts)


@each_schedule
def test_collective_matmul_inside_a_stage(schedule):
  """Sequence-parallel MLP: gather the rows while multiplying, scatter the
  sums while multiplying; the norm scale replicated over 'tp'."""
  def stage(w, x):   # x: (rows/tp, D); up: (D, F/tp); down: (F/tp, D)
    h = all_gather_matmul(x * w["scale"], w["up"], "tp")
    return x + matmul_reduce_scatter(jnp.tanh(h), w["down"], "tp")

  def reference(w, x):
    return x + jnp.tanh((x * w["scale"]) @ w["up"]) @ w["down"]
  w, xs, ts = _data(_stages(schedule), batch=4, scale=(D,), up=(D, F), down=(F, D))
  specs = {"scale": P("pp"), "up": P("pp", None, "tp"), "down": P("pp", "tp", None)}
  loss = _pipelined(stage, _mesh(2, 2, "tp"), specs, P(None, "tp"), "tp",
                    schedule=schedule)
  _check(loss, _sequential(reference), w, xs, ts)


@each_schedule
def test_a_plain_ppermute_inside_a_stage(schedule):
  def stage(w, x):   # rotate the rows over 'cp' and back: the identity
    y = jax.lax.ppermute(x, "cp", [(0, 1), (1, 0)])
    return jax.lax.ppermute(jnp.tanh(y @ w), "cp", [(0, 1), (1, 0)])
  w = jax.random.normal(jax.random.key(3), (_stages(schedule), D, D)) / 2
  _, xs, ts = _data(_stages(schedule))
  loss = _pipelined(stage, _mesh(2, 2, "cp"), P("pp"), P(None, "cp"), "cp",
                    schedule=schedule)
  _check(loss, _sequential(lambda w, x: jnp.tanh(x @ w)), w, xs, ts)


def test_switch_dispatch_with_a_collective_is_refused():
  stage = lambda w, x: jax.lax.psum(x @ w, "tp")
  w = jnp.ones((2, D, D))
  _, xs, ts = _data(2)
  loss = _pipelined(stage, _mesh(2, 2, "tp"), P("pp"), P(), "tp",
                    dispatch="switch")
  with pytest.raises(ValueError, match=r"dispatch='switch'.*stage_fn holds a "
                     r"collective over \['tp'\]"):
    jax.jit(loss)(w, xs, ts)
