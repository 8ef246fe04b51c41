"""pipeline_loss on the ways users write stages and losses: targets that
depend on what is differentiated, pytree microbatches, integer parameter
leaves, a scanned stage, an embedding and an LM head with parameters, aux
values, a microbatch index; and xs sharded over the pipeline axis refused.
Every gradient against the sequential model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss

D, M, P_ = 4, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def _mesh():
  return jax.make_mesh((P_,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:P_])


def _run(body, args, specs):
  return jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=P())(*args)


def _close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jnp.result_type(a) == jax.dtypes.float0:
      continue
    np.testing.assert_allclose(a, b, **TOL)


def _weights(seed=0):
  return jax.random.normal(jax.random.key(seed), (P_, D, D)) / 2


def _xs(seed=1, shape=(M, 2, D)):
  return jax.random.normal(jax.random.key(seed), shape)


def test_targets_that_depend_on_what_is_differentiated():
  """An autoencoder: the targets are the inputs; d/dxs has both paths."""
  stage = lambda w, x: jnp.tanh(x @ w)

  def piped(w, xs):
    body = lambda w, xs: pipeline_loss(stage, mse, w, xs, xs, axis="pp")
    return _run(body, (pipeline_stage_layout(w, P_), xs), (P("pp"), P()))

  def ref(w, xs):
    y = xs
    for g in range(P_):
      y = stage(w[g], y)
    return mse(y, xs)
  w, xs = _weights(), _xs()
  _close(jax.jit(jax.value_and_grad(piped, (0, 1)))(w, xs),
         jax.jit(jax.value_and_grad(ref, (0, 1)))(w, xs))


def test_xs_sharded_over_the_pipeline_axis_is_refused():
  body = lambda w, xs: pipeline_loss(lambda w, x: x @ w, mse, w, xs, xs, axis="pp")
  with pytest.raises(ValueError, match=r"xs is sharded over the pipeline axis 'pp'"):
    _run(body, (_weights(), _xs()), (P("pp"), P("pp")))


def test_pytree_microbatches_with_integer_leaves_and_parameters():
  """The activation carries positions (int) beside the hidden state; a
  stage's params hold its layer id (int) beside the weight."""
  def stage(prm, x):
    h = jnp.tanh(x["h"] @ prm["w"]) + 0.1 * prm["layer"] + 0.01 * x["pos"][..., None]
    return {"h": h, "pos": x["pos"]}

  def piped(prm, xs):
    body = lambda q, xs: pipeline_loss(stage, lambda y, t: mse(y["h"], t), q, xs,
                                       xs["h"], axis="pp")
    return _run(body, (pipeline_stage_layout(prm, P_), xs), (P("pp"), P()))

  def ref(prm, xs):
    y = xs
    for g in range(P_):
      y = stage(jax.tree.map(lambda a: a[g], prm), y)
    return mse(y["h"], xs["h"])
  prm = {"w": _weights(), "layer": jnp.arange(P_)}
  xs = {"h": _xs(), "pos": jnp.broadcast_to(jnp.arange(2), (M, 2))}
  got = jax.jit(jax.value_and_grad(piped, (0, 1), allow_int=True))(prm, xs)
  want = jax.jit(jax.value_and_grad(ref, (0, 1), allow_int=True))(prm, xs)
  assert got[1][0]["layer"].dtype == jax.dtypes.float0
  _close(got, want)


@pytest.mark.parametrize("embed", [False, True])
def test_a_scanned_stage(embed):
  """A stage that runs its layers with lax.scan (MaxText, nn.scan, equinox
  stacks): the check traces it with the executor's activation type, also
  where `before` makes the activation."""
  def stage(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  before = (lambda x: 2.0 * x) if embed else None

  def piped(ws, xs, ts):
    body = lambda q, xs, ts: pipeline_loss(stage, mse, q, xs, ts, axis="pp",
                                           before=before)
    return _run(body, (pipeline_stage_layout(ws, P_), xs, ts), (P("pp"), P(), P()))

  def ref(ws, xs, ts):
    y = before(xs) if embed else xs
    for g in range(P_):
      y = stage(ws[g], y)
    return mse(y, ts)
  ws = jax.random.normal(jax.random.key(0), (P_, 3, D, D)) / 2
  xs, ts = _xs(), _xs(2)
  _close(jax.jit(jax.value_and_grad(piped, (0, 1, 2)))(ws, xs, ts),
         jax.jit(jax.value_and_grad(ref, (0, 1, 2)))(ws, xs, ts))


@pytest.mark.parametrize("lookup", ["index", "take"])
def test_an_embedding_and_an_lm_head_with_parameters(lookup):
  """Token ids in, an embedding table in `before`, an LM head (vocab >
  width) closed over by loss_fn: every gradient flows, aux values too.
  `jnp.take` is a jax.jit call, whose pvary of the table is inside it."""
  vocab = 7
  embed = (lambda table, tok: table[tok]) if lookup == "index" else (
      lambda table, tok: jnp.take(table, tok, axis=0))

  def stage(w, x):
    return x + jnp.tanh(x @ w)

  def head_loss(head, y, t):
    logits = y @ head
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], -1)
    return jnp.mean(nll), {"max_logit": jnp.max(logits)}

  def piped(w, table, head, tokens, labels):
    def body(w, table, head, tokens, labels):
      return pipeline_loss(stage, lambda y, t: head_loss(head, y, t), w, tokens,
                           labels, axis="pp", before=lambda tok: embed(table, tok),
                           has_aux=True)
    return jax.shard_map(body, mesh=_mesh(), in_specs=(P("pp"), P(), P(), P(), P()),
                         out_specs=(P(), P()))(pipeline_stage_layout(w, P_), table,
                                               head, tokens, labels)

  def ref(w, table, head, tokens, labels):
    def one(tok, lab):
      y = embed(table, tok)
      for g in range(P_):
        y = stage(w[g], y)
      return head_loss(head, y, lab)
    loss, aux = jax.vmap(one)(tokens, labels)
    return jnp.mean(loss), aux
  k = jax.random.split(jax.random.key(0), 4)
  table = jax.random.normal(k[0], (vocab, D))
  head = jax.random.normal(k[1], (D, vocab))
  tokens = jax.random.randint(k[2], (M, 3), 0, vocab)
  labels = jax.random.randint(k[3], (M, 3), 0, vocab)
  args = (_weights(), table, head, tokens, labels)
  got = jax.jit(jax.value_and_grad(piped, (0, 1, 2), has_aux=True))(*args)
  want = jax.jit(jax.value_and_grad(ref, (0, 1, 2), has_aux=True))(*args)
  _close(got, want)


def test_the_microbatch_index_reaches_the_stage():
  """Dropout that differs by microbatch: the stage folds the index into a
  key it closes over."""
  key = jax.random.key(5)

  def stage(w, x, *, microbatch):
    keep = jax.random.bernoulli(jax.random.fold_in(key, microbatch), 0.7, x.shape)
    return jnp.where(keep, jnp.tanh(x @ w), 0.0)

  def piped(w, xs, ts):
    body = lambda q, xs, ts: pipeline_loss(stage, mse, q, xs, ts, axis="pp")
    return _run(body, (pipeline_stage_layout(w, P_), xs, ts), (P("pp"), P(), P()))

  def ref(w, xs, ts):
    def one(i, x, t):
      for g in range(P_):
        x = stage(w[g], x, microbatch=i)
      return mse(x, t)
    return jnp.mean(jax.vmap(one)(jnp.arange(M), xs, ts))
  w, xs, ts = _weights(), _xs(), _xs(2)
  _close(jax.jit(jax.value_and_grad(piped, (0, 1)))(w, xs, ts),
         jax.jit(jax.value_and_grad(ref, (0, 1)))(w, xs, ts))
