"""`inspect` and `measure` on steps written the way public model code writes
them (issue 27, items 5, 6 and 10): a flax `nnx.jit` train step, an
`eqx.filter_jit` step over an equinox module with a non-array field, and a
`fsdp_scan` step inside `jax.shard_map` under `jax.value_and_grad`.

One fsdp step (2 layers, tiny shapes) is shared by the report tests; each
test fails on the code before its fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.inspection.report.summary import hints_for

AXIS = "d"


def _mesh():
  return jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _batch(mesh, shape):
  x = jnp.linspace(-1.0, 1.0, shape[0] * shape[1]).reshape(shape)
  return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


# --- item 5: flax nnx.jit ----------------------------------------------------------

def test_inspect_and_measure_take_an_nnx_jit_train_step():
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")

  # Adapted from the flax NNX MNIST tutorial's `train_step`
  # (flax.readthedocs.io, "MNIST tutorial"): nnx.jit over model and optimizer.
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 8, rngs=rngs)
      self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, opt, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  mesh = _mesh()
  x, y = _batch(mesh, (8, 4)), _batch(mesh, (8, 2))
  report = jo.overlap_report(train_step)(model, opt, x, y)  # was AttributeError
  assert report.schedule == "compiled"
  # The batch is sharded: XLA sums the replicated weights' gradients.
  assert "all-reduce" in {c.kind for c in report.collectives}, report.table()
  written = jo.overlap_report(train_step, schedule="written")(model, opt, x, y)
  assert written.schedule == "written"


# --- item 6: eqx.filter_jit over a module with a non-array field ----------------

@pytest.fixture(scope="module")
def eqx_step():
  eqx = pytest.importorskip("equinox")
  # Adapted from equinox's README example (eqx.nn.MLP under filter_jit and
  # filter_value_and_grad); `activation` is a jax function, not an array.
  model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.relu,
                     key=jax.random.PRNGKey(0))

  def loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)

  def step(model, x):
    return eqx.filter_value_and_grad(loss)(model, x)

  return eqx.filter_jit(step), step, model, _batch(_mesh(), (8, 4))


def test_inspect_and_measure_keep_eqx_filter_jit(eqx_step):
  jitted, _, model, x = eqx_step
  # was: jax.jit traced `activation`
  report = jo.overlap_report(jitted)(model, x)
  assert "all-reduce" in {c.kind for c in report.collectives}, report.table()
  measured = jo.measure(jitted, steps=1, warmup=0)(model, x)
  assert {r.kind for r in measured.measured} >= {"all-reduce"}


def test_a_plain_function_of_a_module_names_the_argument(eqx_step):
  _, plain, model, x = eqx_step
  for run in (jo.overlap_report, jo.measure):
    with pytest.raises(TypeError, match=r"args\[0\]\.activation is a .*not an "
                       r"array.*eqx\.filter_jit\(fn\)"):
      run(plain)(model, x)


# --- item 10: the fsdp_scan step's report -------------------------------------------

@pytest.fixture(scope="module")
def fsdp_step():
  """A 2-layer fsdp_scan stack with a replicated head (in_specs P()), as in
  the fsdp_scan docstring: autodiff sums the head's gradient."""
  mesh = _mesh()

  def layer(x, w):
    return jnp.tanh(x @ w)

  def loss(ws, head, x):
    y = jo.fsdp_scan(layer, x, ws, axis=AXIS)
    return jax.lax.pmean(jnp.mean((y @ head) ** 2), AXIS)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(None, AXIS), P(), P(AXIS)),
                 out_specs=(P(), (P(None, AXIS), P())))
  def step(ws, head, x):
    return jax.value_and_grad(loss, argnums=(0, 1))(ws, head, x)

  args = (jnp.full((2, 8, 8), 0.1), jnp.ones((8, 4)), jnp.ones((16, 8)))
  return step, args, jo.overlap_report(step)(*args)


def test_autodiff_all_reduce_is_not_told_to_use_psum_start(fsdp_step):
  _, _, report = fsdp_step
  assert report.schedule == "written"
  summed = [c for c in report.collectives
            if c.kind == "all-reduce" and "from autodiff" in c.flags]
  assert summed, report.table()
  hints = hints_for(report)
  for c in summed:
    about = [h for h in hints if c.start in h]
    assert about and all("psum_start and call" not in h for h in about), hints
    assert any("autodiff inserted" in h and "shard" in h for h in about), hints


def test_transposed_future_pairs_with_its_own_done():
  mesh = _mesh()

  # The gradient of a gather started by hand is the reduce-scatter autodiff
  # starts where the gather finished; its done is written with the forward
  # future's comm.
  def loss(w, x):
    fut = jo.all_gather_start(w, AXIS, tiled=True)
    h = jnp.tanh(x @ x.T)
    return jax.lax.pmean(jnp.mean((h @ x @ fut.done()) ** 2), AXIS)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                 out_specs=(P(), P(AXIS)))
  def step(w, x):
    return jax.value_and_grad(loss)(w, x)

  report = jo.overlap_report(step)(jnp.ones((8, 8)), jnp.ones((16, 8)))
  scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
  assert scatters, report.table()
  for c in scatters:
    assert c.start.startswith("psum_scatter_start"), c
    assert c.done.startswith("psum_scatter_done"), c   # was all_gather_done.2
  assert all("done() not found" not in w.flags for w in report.written), (
      report.written)


def test_measured_rows_name_source_line_and_leaf_as_inspect_does(fsdp_step):
  step, args, _ = fsdp_step
  compiled = jo.overlap_report(step, schedule="compiled")(*args)
  by_name = {c.start: c for c in compiled.collectives}
  measured = jo.measure(step, steps=1, warmup=0)(*args)
  assert measured.measured
  for r in measured.measured:
    c = by_name[r.name]
    assert (r.where, r.leaf) == (c.where, c.leaf), (r, c)
    assert r.where is not None and r.to_dict()["where"] == r.where
  # fsdp_scan names each transfer's leaf, also inside jvp(...)/transpose(...).
  assert all(r.leaf == "()" for r in measured.measured
             if r.kind != "all-reduce"), measured.measured
  line = next(r for r in measured.measured if r.leaf)
  assert f"leaf {line.leaf}" in str(measured)
