"""pipeline_loss: values and gradients equal the sequential model's."""

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap._src.patterns.pipeline import buffers, placing as plan_lib
from jax_overlap._src.patterns.pipeline.actions import B, I, Pair, parts
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss
from pipeline_model import (WIDTH, mesh, model, mse, pipelined_loss,
                            sequential_loss, stage)

TOL = dict(rtol=1e-5, atol=1e-6)


def _grid():
  for p, k in itertools.product((2, 4), (1, 2, 3)):
    for schedule in ("gpipe", "1f1b", "zb-h1"):
      yield schedule, p, k * p, 1
    yield "interleaved", p, k * p, 2
  for p, m in ((2, 4), (2, 3), (4, 8), (4, 6)):   # m = 2p and one not a multiple
    yield "zb-v", p, m, 2
  for p in (2, 4):   # DualPipeV needs m >= 2p
    yield "dualpipev", p, 2 * p, 2


def _check(loss, ref, params, xs, ts):
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, xs, ts)
  want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(params, xs, ts)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)
  np.testing.assert_allclose(jax.jit(loss)(params, xs, ts), want[0], **TOL)


# On older jax: each schedule once, both stage counts covered (the grid's
# other cells differ only in sizes the schedule code does not branch on by jax
# version).
@pytest.mark.newest_jax(older_jax=[
    "test_values_and_gradients[gpipe-2-4-1]", "test_values_and_gradients[1f1b-4-4-1]",
    "test_values_and_gradients[zb-h1-2-6-1]",
    "test_values_and_gradients[zb-v-2-3-2]",
    "test_values_and_gradients[dualpipev-2-4-2]",
    "test_values_and_gradients[interleaved-2-4-2]"])
@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,v", list(_grid()))
def test_values_and_gradients(schedule, p, m, v):
  params, xs, ts = model(p * v, m)
  _check(pipelined_loss(p, schedule=schedule, virtual_stages=v),
         sequential_loss, params, xs, ts)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                        ("zb-v", 2), ("dualpipev", 2)])
def test_waiting_sends_give_the_same(schedule, v):
  params, xs, ts = model(2 * v, 4)
  _check(pipelined_loss(2, schedule=schedule, virtual_stages=v, send_ticks=0),
         sequential_loss, params, xs, ts)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_inside_a_larger_loss(schedule):
  """An embedding before the pipeline, a regulariser beside it."""
  p, m = 2, 4
  params, _, ts = model(p, m)
  tokens = jax.random.randint(jax.random.key(1), (m, 2), 0, 5)
  table = jax.random.normal(jax.random.key(2), (5, 4))
  piped = pipelined_loss(p, schedule=schedule)

  def full(loss):
    def f(params, table):
      xs = jnp.take(table, tokens, axis=0)
      reg = 0.1 * sum(jnp.sum(a ** 2) for a in jax.tree.leaves(params))
      return 3.0 * loss(params, xs, ts) + reg
    return f

  got = jax.jit(jax.value_and_grad(full(piped), argnums=(0, 1)))(params, table)
  want = jax.jit(jax.value_and_grad(full(sequential_loss), argnums=(0, 1)))(params, table)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


def test_checkpointed_stage():
  params, xs, ts = model(2, 4)     # p = 4 and larger m: the slow grid
  _check(pipelined_loss(2, stage_fn=jax.checkpoint(stage)), sequential_loss,
         params, xs, ts)


def test_integer_targets():
  p, m = 2, 2
  params, xs, _ = model(p, m)
  labels = jnp.array([[1, 3], [0, 2]])

  def xent(y, t):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(y), t[:, None], 1))

  def piped(params, xs):
    body = lambda q, x, t: pipeline_loss(stage, xent, q, x, t, axis="pp")
    return jax.shard_map(body, mesh=mesh(p), in_specs=(P("pp"), P(), P()),
                         out_specs=P())(params, xs, labels)

  def ref(params, xs):
    def one(x, t):
      for g in range(p):
        x = stage(jax.tree.map(lambda a: a[g], params), x)
      return xent(x, t)
    return jnp.mean(jax.vmap(one)(xs, labels))

  got = jax.jit(jax.value_and_grad(piped))(params, xs)
  want = jax.jit(jax.value_and_grad(ref))(params, xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


def _jitted_model(p, schedule):
  """(params, xs, ts, table, head, shift) -> a loss, jitted and then
  differentiated: the embedding `table` and the LM `head` traced and closed
  over by `before` and `loss_fn`, and `shift` a traced int the loss closes
  over. pipeline_loss(piped=True) pipelines it, False runs it in order."""
  def loss(params, xs, ts, table, head, shift, *, piped):
    def before(x):
      return jnp.tanh(x @ table)

    def loss_fn(y, t):
      return jnp.mean((jnp.roll(y @ head, shift, axis=-1) - t) ** 2)

    if not piped:
      def one(x, t):
        x = before(x)
        for g in range(p):
          x = stage(jax.tree.map(lambda a: a[g], params), x)
        return loss_fn(x, t)
      return jnp.mean(jax.vmap(one)(xs, ts))
    body = lambda q, x, t: pipeline_loss(stage, loss_fn, q, x, t, axis="pp",
                                         schedule=schedule, before=before)
    return jax.shard_map(body, mesh=mesh(p), in_specs=(P("pp"), P(), P()),
                         out_specs=P())(params, xs, ts)
  return loss


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("transform", ["grad", "value_and_grad"])
def test_gradient_of_a_jitted_program(schedule, transform):
  """grad(jit(shard_map(pipeline_loss))): grad traces the custom_vjp's
  forward rule again after jit's trace, where a value pipeline_loss made
  in that trace and the rule closed over was a leaked tracer ("No constant
  handler for type: DynamicJaxprTracer", issue 43)."""
  p, m = 2, 4
  params, xs, ts = model(p, m)
  table = jax.random.normal(jax.random.key(3), (WIDTH, WIDTH)) / 2
  head = jax.random.normal(jax.random.key(4), (WIDTH, WIDTH)) / 2
  args = (params, xs, ts, table, head, jnp.int32(1))
  loss = _jitted_model(p, schedule)
  diff = getattr(jax, transform)
  got = diff(jax.jit(partial(loss, piped=True)), argnums=(0, 1, 2, 3, 4))(*args)
  want = diff(jax.jit(partial(loss, piped=False)), argnums=(0, 1, 2, 3, 4))(*args)
  assert len(jax.tree.leaves(want)) == len(jax.tree.leaves(got))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


# what the stage closes over: a traced float scale, a traced int (a step
# count the stage mixes with a literal), both
CLOSED = {
    "float": lambda c, k: (lambda prm, x: stage(prm, x * c)),
    "int": lambda c, k: (lambda prm, x: stage(prm, x * (k + 1).astype(x.dtype))),
    "both": lambda c, k: (lambda prm, x: stage(prm, x * c * (k + 1).astype(x.dtype))),
}


@pytest.mark.parametrize("closed", sorted(CLOSED))
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("order", ["grad_of_jit", "jit_of_grad"])
def test_stage_closing_over_traced_values(order, recompute, closed):
  """A stage_fn closing over a traced float gets its gradient; it was a
  leaked tracer in the custom_vjp's rules (CustomVJPException,
  UnexpectedTracerError, or the constant-handler TypeError under jit). One
  closing over a traced int runs too: it leaked under grad of jit, and the
  kept residuals' layout cast it varying, which `k + 1` refused."""
  p, m = 2, 4
  params, xs, ts = model(p, m)
  scaled = CLOSED[closed]

  def piped(params, xs, ts, c, k):
    body = lambda q, x, t: pipeline_loss(scaled(c, k), mse, q, x, t,
                                         axis="pp", recompute=recompute)
    return jax.shard_map(body, mesh=mesh(p), in_specs=(P("pp"), P(), P()),
                         out_specs=P())(params, xs, ts)

  ref = lambda params, xs, ts, c, k: sequential_loss(params, xs, ts,
                                                     scaled(c, k))
  args = (params, xs, ts, jnp.float32(1.5), jnp.int32(2))
  diff = lambda f: jax.value_and_grad(f, argnums=(0, 1, 3))
  run = ((lambda f: diff(jax.jit(f))) if order == "grad_of_jit"
         else (lambda f: jax.jit(diff(f))))
  got, want = run(piped)(*args), run(ref)(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


def test_rows_are_the_live_activations():
  """1F1B's rows a device keeps are flat in m; GPipe's grow with it."""
  rows = lambda s, m: buffers.program(plan_lib.pipeline_schedule(
      s, 4, m, send_ticks=1)).slots
  assert rows("1f1b", 8) == rows("1f1b", 32) <= 2 * 4
  assert rows("gpipe", 8) == 8 and rows("gpipe", 32) == 32
  # ZB-V: a row a chunk-microbatch, flat in m from m = 4p (17 at p = 4: the
  # 14 live chunk-microbatches of its peak and inputs received before the
  # cap lets their forward run)
  v_rows = lambda m: buffers.program(plan_lib.pipeline_schedule(
      "zb-v", 4, m, 2, send_ticks=1)).slots
  assert v_rows(16) == v_rows(64) == 17


def test_zb_v_sends_each_way_and_turns_on_the_device():
  """On ZB-V's V a device can receive activations from both neighbours at
  one tick (chunk 0's going down the devices, chunk 1's up): each way is a
  ppermute of its own, no destination twice in one; the turn from stage p-1
  to stage p (and its cotangent back) is written on device p-1 with no
  collective; and each deferred send has the next tick's compute between
  its start and done()."""
  p, m = 4, 8
  params, xs, ts = model(2 * p, m)
  prog = buffers.program(plan_lib.pipeline_schedule("zb-v", p, m, 2))
  sends = [(t, s) for t, tick in enumerate(prog.ticks) for s in tick.sends]
  assert all(len({d for _, d in s.perm}) == len(s.perm) for _, s in sends)
  assert any(sum(not s.local and s.buffer == "inputs" for s in tick.sends) == 2
             for tick in prog.ticks)
  local = [s for _, s in sends if s.local]
  assert len(local) == 2 * m          # each microbatch's turn, F and I
  assert all(s.slots[:p - 1] == (-1,) * (p - 1) for s in local)
  remote = [(t, s) for t, s in sends if not s.local]
  computing = [t for t, s in remote if s.deferred
               and set(prog.ticks[t + 1].branch) != {buffers.IDLE}]
  assert _sends_in_flight(pipelined_loss(p, schedule="zb-v", virtual_stages=2),
                          len(remote), params, xs, ts) >= len(computing)


@pytest.mark.slow
def test_dualpipev_pairs_run_both_parts_in_one_tick():
  """An F&B cell: the program's tick holds the Pair's backward beside its
  forward (Tick.second), each with its own microbatch, chunk and row; at
  p=4, m=8 one tick holds a B on one device and an I on another, which
  lockstep runs as two slots, each device sending back its own. Values and
  gradients equal the sequential model's in lockstep (the grid runs
  switch)."""
  p, m = 4, 8
  plan = plan_lib.pipeline_schedule("dualpipev", p, m, 2)
  prog = buffers.program(plan)
  paired = [t for t, tick in enumerate(prog.ticks) if tick.second]
  assert paired and all(
      any(isinstance(c, Pair) for c in plan.table[t]) for t in paired)
  for t in paired:
    tick = prog.ticks[t]
    for d, c in enumerate(plan.table[t]):
      if isinstance(c, Pair):
        assert tick.branch[d] in (buffers.F_FIRST, buffers.F_MID, buffers.F_LAST)
        assert tick.second[0][d] in (buffers.B_FIRST, buffers.B_MID)
        assert (tick.microbatch[d], tick.second[1][d]) == (
            c.forward.microbatch, c.backward.microbatch)
        assert tick.slot[d] != tick.second[3][d]
  kinds = lambda row: {a.kind for c in row for a in parts(c)}
  assert any({B, I} <= kinds(row) for row in plan.table)
  params, xs, ts = model(2 * p, m)
  _check(pipelined_loss(p, schedule="dualpipev", virtual_stages=2,
                        dispatch="lockstep"), sequential_loss, params, xs, ts)


def test_sends_are_futures_in_flight_over_the_next_tick():
  """Each send is a ppermute future; with send_ticks=1 every one is finished
  after the next tick, and where that tick computes (not all idle) its
  compute (a switch, or the stage's matmul where every device runs one
  branch) lies between start and done()."""
  p, m = 4, 8
  params, xs, ts = model(p, m)
  prog = buffers.program(plan_lib.pipeline_schedule("1f1b", p, m, send_ticks=1))
  sends = [(t, s) for t, tick in enumerate(prog.ticks) for s in tick.sends]
  assert all(s.deferred for _, s in sends)
  computing = [t for t, _ in sends
               if set(prog.ticks[t + 1].branch) != {buffers.IDLE}]
  assert len(computing) >= len(sends) - 3      # the drain's idle ticks
  assert _sends_in_flight(pipelined_loss(p, send_ticks=1), len(sends),
                          params, xs, ts) == len(computing)


def test_the_default_1f1b_alternates_and_hides_the_steady_states_sends():
  """The default table: one kind of action a tick, the literature's 2(m+p-1)
  ticks; every send but the warm-up's and the drain's (3 + 3 at p = 4) is
  finished after a tick of the other kind, with that tick's compute
  between its start and done()."""
  p, m = 4, 8
  params, xs, ts = model(p, m)
  plan = plan_lib.pipeline_schedule("1f1b", p, m)
  assert plan.ticks == 2 * (m + p - 1)
  assert all(len({a.kind for a in row if a}) <= 1 for row in plan.table)
  prog = buffers.program(plan)
  sends = [s for tick in prog.ticks for s in tick.sends]
  deferred = sum(s.deferred for s in sends)
  assert deferred == len(sends) - 2 * (p - 1)
  assert _sends_in_flight(pipelined_loss(p), len(sends), params, xs, ts) == deferred


def _sends_in_flight(loss, n_sends, params, xs, ts) -> int:
  """How many of the traced program's sends have a cond or a matmul between
  their start and done()."""
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params, xs, ts)
  eqns = _flat_eqns(jaxpr.jaxpr)
  starts = [i for i, e in enumerate(eqns) if e.primitive.name == "collective_start"]
  assert len(starts) == n_sends
  in_flight = 0
  for i in starts:
    out = eqns[i].outvars[0]
    j = next(k for k, e in enumerate(eqns) if k > i and e.primitive.name
             == "collective_done" and any(v is out for v in e.invars))
    if any(e.primitive.name in ("cond", "dot_general") for e in eqns[i + 1:j]):
      in_flight += 1
  return in_flight


def _flat_eqns(jaxpr):
  out = []
  for e in jaxpr.eqns:
    inner = e.params.get("jaxpr") or e.params.get("call_jaxpr") or e.params.get(
        "fun_jaxpr")
    if inner is not None and e.primitive.name != "cond":
      out += _flat_eqns(getattr(inner, "jaxpr", inner))
    else:
      out.append(e)
  return out


class TestMisuse:

  def _run(self, p=2, m=4, stage_fn=stage, params=None, **kw):
    prm, xs, ts = model(p, m)
    body = lambda q, x, t: pipeline_loss(stage_fn, mse, q, x, t, axis="pp", **kw)
    return jax.shard_map(body, mesh=mesh(p), in_specs=(P("pp"), P(), P()),
                         out_specs=P())(prm if params is None else params, xs, ts)

  def test_wrong_leading_axis(self):
    prm, _, _ = model(2, 4)
    with pytest.raises(ValueError, match=r"stage_params\['b'\].*virtual_stages=2"):
      self._run(params=prm, schedule="interleaved", virtual_stages=2)

  def test_zb_v_without_two_chunks(self):
    with pytest.raises(ValueError, match=r"schedule='zb-v'.*virtual_stages=1; "
                       r"pass virtual_stages=2"):
      self._run(schedule="zb-v")

  def test_dualpipev_without_two_chunks(self):
    with pytest.raises(ValueError, match=r"schedule='dualpipev'.*"
                       r"virtual_stages=1; pass virtual_stages=2"):
      self._run(schedule="dualpipev")

  def test_dualpipev_too_few_microbatches(self):
    with pytest.raises(ValueError, match=r"schedule='dualpipev' needs "
                       r"microbatches >= 2 \* stages \(got microbatches=3"):
      self._run(m=3, params=model(4, 3)[0], schedule="dualpipev",
                virtual_stages=2)

  def test_too_few_microbatches(self):
    with pytest.raises(ValueError, match="microbatches >= stages"):
      self._run(p=4, m=2)

  def test_stage_changing_the_shape(self):
    with pytest.raises(ValueError, match=r"stage_fn must return .*float32\[2, 4\]"):
      self._run(stage_fn=lambda prm, x: (x @ prm["w"])[:, :2])

  def test_collective_over_the_axis(self):
    with pytest.raises(ValueError, match="collective over the pipeline axis 'pp'"):
      self._run(stage_fn=lambda prm, x: jax.lax.psum(stage(prm, x), "pp"))

  def test_not_inside_shard_map(self):
    prm, xs, ts = model(2, 4)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
      pipeline_loss(stage, mse, prm, xs, ts, axis="pp")

  def test_unknown_schedule(self):
    with pytest.raises(ValueError, match="schedule='pipedream'"):
      self._run(schedule="pipedream")

  @pytest.mark.parametrize("order", ["grad_of_grad", "hessian"])
  def test_second_derivatives_are_refused(self, order):
    """Differentiating the schedule's backward would hang on its sends."""
    prm, xs, ts = model(2, 2)
    f = lambda x: pipelined_loss(2)(prm, x, ts)
    second = (jax.grad(lambda x: jax.grad(f)(x).sum()) if order == "grad_of_grad"
              else jax.hessian(f))
    with pytest.raises(NotImplementedError, match="first derivatives only"):
      second(xs)
