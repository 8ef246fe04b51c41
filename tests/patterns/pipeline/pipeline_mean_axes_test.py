"""pipeline_loss(mean_axes=...): the loss averaged over data-parallel axes
inside the pipeline gives the values and gradients of `pmean`ing it outside,
is invariant over those axes, and starts the replicated stage weights'
gradient sums over them as a future when the ticks end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.collectives import tpu_forms
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

D, F, M = 4, 8, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _mesh(**axes):
  n = int(np.prod(list(axes.values())))
  return jax.make_mesh(tuple(axes.values()), tuple(axes),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                       devices=jax.devices()[:n])


def _stage(w, x):   # a norm scale and a bias, replicated over every other axis
  return jnp.tanh((x * w["scale"]) @ w["w"] + w["b"])


def _data(p=2):
  k = jax.random.split(jax.random.key(0), 6)
  w = {"scale": 1.0 + jax.random.normal(k[0], (p, D)) / 4,
       "w": jax.random.normal(k[1], (p, D, D)) / 2,
       "b": jax.random.normal(k[2], (p, D)) / 4}
  emb = jax.random.normal(k[3], (D, D))
  xs = jax.random.normal(k[4], (M, 4, D))
  ts = jax.random.normal(k[5], (M, 4, D))
  return w, emb, xs, ts


def _sequential(w, emb, xs, ts):
  def one(x, t):
    x = jnp.tanh(x @ emb)
    for g in range(w["w"].shape[0]):
      x = _stage(jax.tree.map(lambda a: a[g], w), x)
    return mse(x, t)
  return jnp.mean(jax.vmap(one)(xs, ts))


def _pipelined(mesh, x_spec, mean_axes, outside=(), **kw):
  """The pipelined loss, averaged over `mean_axes` by pipeline_loss and over
  `outside` by a pmean after it; the embedding `emb` closed over by
  `before` (its gradient is autodiff's sum of the parts)."""
  def body(w, emb, xs, ts):
    loss = pipeline_loss(_stage, mse, w, xs, ts, axis="pp",
                         before=lambda x: jnp.tanh(x @ emb),
                         mean_axes=mean_axes, **kw)
    return jax.lax.pmean(loss, outside) if outside else loss

  def loss(w, emb, xs, ts):
    return jax.shard_map(body, mesh=mesh, in_specs=(P("pp"), P(), x_spec, x_spec),
                         out_specs=P())(pipeline_stage_layout(w, 2), emb, xs, ts)
  return loss


def _check(loss, w, emb, xs, ts):
  args = (w, emb, xs, ts)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
  want = jax.jit(jax.value_and_grad(_sequential, argnums=(0, 1, 2, 3)))(*args)
  np.testing.assert_allclose(got[0], want[0], **TOL)
  np.testing.assert_allclose(jax.jit(loss)(*args), want[0], **TOL)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]),
                          jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("schedule, dispatch", [("1f1b", "switch"), ("1f1b", "lockstep"),
                                                ("zb-h1", None), ("gpipe", None)])
def test_dp_mean_inside_equals_the_model(schedule, dispatch):
  """The batch sharded over 'dp', the weights replicated over it; no pmean
  outside (the loss comes back invariant over 'dp', so out_specs=P()
  accepts it)."""
  _check(_pipelined(_mesh(pp=2, dp=2), P(None, "dp"), "dp", schedule=schedule,
                    dispatch=dispatch), *_data())


def test_two_data_axes_and_one_left_outside():
  """mean_axes a tuple; another data axis still pmean'ed outside."""
  mesh = _mesh(pp=2, dp=2, dq=2)
  _check(_pipelined(mesh, P(None, ("dp", "dq")), ("dp", "dq")), *_data())
  _check(_pipelined(mesh, P(None, ("dp", "dq")), "dq", outside="dp"), *_data())


def test_inputs_replicated_over_the_axis():
  """xs replicated over 'dp' (every device the same microbatches): the mean
  is of equal losses, and xs's gradient is summed over 'dp' too."""
  _check(_pipelined(_mesh(pp=2, dp=2), P(), "dp"), *_data())


@pytest.mark.parametrize("forms", [False, True])
def test_tensor_parallel_stage_with_a_replicated_scale(forms):
  """The stage's psum over 'tp' (lockstep), the scale replicated over 'tp',
  the up/down weights split over it: mean over ('dp', 'tp'). With the TPU
  forms forced (as on TPU) up and down share one future over 'dp' and the
  scale's sum over both axes is a plain psum."""
  def stage(w, x):
    h = x * w["scale"]
    return x + jax.lax.psum(jnp.tanh(h @ w["up"]) @ w["down"], "tp")

  def reference(w, xs, ts):
    def one(x, t):
      for g in range(2):
        wg = jax.tree.map(lambda a: a[g], w)
        x = x + jnp.tanh((x * wg["scale"]) @ wg["up"]) @ wg["down"]
      return mse(x, t)
    return jnp.mean(jax.vmap(one)(xs, ts))

  k = jax.random.split(jax.random.key(1), 5)
  w = {"scale": 1.0 + jax.random.normal(k[0], (2, D)) / 4,
       "up": jax.random.normal(k[1], (2, D, F)) / 2,
       "down": jax.random.normal(k[2], (2, F, D)) / 2}
  xs, ts = (jax.random.normal(kk, (M, 4, D)) for kk in k[3:])
  specs = {"scale": P("pp"), "up": P("pp", None, "tp"), "down": P("pp", "tp", None)}
  mesh = _mesh(pp=2, dp=2, tp=2)

  def loss(w, xs, ts):
    body = lambda w, xs, ts: pipeline_loss(stage, mse, w, xs, ts, axis="pp",
                                           mean_axes=("dp", "tp"))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(None, "dp"), P(None, "dp")),
                         out_specs=P())(pipeline_stage_layout(w, 2), xs, ts)
  with tpu_forms.forced(forms):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, xs, ts)
  want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(w, xs, ts)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


def _collective_starts(jaxpr, axes, found=None):
  """The collective of every future started over exactly `axes` in `jaxpr`
  and its sub-jaxprs."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    comm = eqn.params.get("comm")
    names = (getattr(comm, "params", None) or {}).get("axis_name")
    if eqn.primitive.name == "collective_start" and names is not None:
      names = (names,) if isinstance(names, str) else tuple(names)
      if set(names) == set(axes):
        found.append(comm.name)
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _collective_starts(inner, axes, found)
  return found


def test_each_replicated_weight_sum_is_a_future():
  """With mean_axes the gradient of each stage leaf replicated over 'dp'
  (3 here) is summed by a future started in the schedule's forward rule,
  none without (there autodiff's psum after the cotangent's scaling); with
  the TPU forms (forced, as on TPU) one future joins the 3 leaves."""
  w, emb, xs, ts = _data()
  mesh = _mesh(pp=2, dp=2)
  for mean_axes, outside, want in (("dp", (), 3), ((), "dp", 0)):
    loss = _pipelined(mesh, P(None, "dp"), mean_axes, outside=outside)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(w, emb, xs, ts)
    assert _collective_starts(jaxpr.jaxpr, ("dp",)) == ["psum"] * want, mean_axes
  with tpu_forms.forced():
    jaxpr = jax.make_jaxpr(jax.grad(_pipelined(mesh, P(None, "dp"), "dp")))(
        w, emb, xs, ts)
  assert _collective_starts(jaxpr.jaxpr, ("dp",)) == ["psum"]


@pytest.mark.parametrize("mean_axes, error, match", [
    ("pp", ValueError, "names the pipeline axis 'pp'"),
    (("dp", "pp"), ValueError, "names the pipeline axis 'pp'"),
    ("data", ValueError, "no mesh axis 'data' is bound"),
    (("dp", "dp"), ValueError, "names an axis twice"),
    ((0,), TypeError, "expected a mesh axis name"),
])
def test_bad_mean_axes_are_refused(mean_axes, error, match):
  w, emb, xs, ts = _data()
  loss = _pipelined(_mesh(pp=2, dp=2), P(None, "dp"), mean_axes, outside="dp")
  with pytest.raises(error, match=match):
    jax.eval_shape(loss, w, emb, xs, ts)


def test_mean_axes_without_varying_types_is_refused():
  """Under check_vma=False nothing says which weights are replicated over
  'dp': refused, where it would silently leave the loss unaveraged."""
  w, _, xs, ts = _data()

  def body(w, xs, ts):
    return pipeline_loss(_stage, mse, w, xs, ts, axis="pp", mean_axes="dp")[None]
  loss = jax.shard_map(body, mesh=_mesh(pp=2, dp=2), in_specs=(P("pp"), P(None, "dp"),
                       P(None, "dp")), out_specs=P("dp"), check_vma=False)
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.eval_shape(loss, pipeline_stage_layout(w, 2), xs, ts)
