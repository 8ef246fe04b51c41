"""expert_parallel: values, drops and gradients against a dense reference,
the overlap in the traced and compiled programs, the docstring example.

The reference sends nothing: every (token, choice) goes through its expert
gathered by hand (`params[expert_ids]`), and the drop rule is applied in
NumPy on each device's tokens (token order, then choice order, per
(source device, expert) pair). The cases cover each value of each
dimension (axis size 1, 2, 4, 8; E_local 1, 2; k 1, 2; chunks 1, 2, 4;
capacity large, tight, dropless; jit and jax.checkpoint, gradients in
every case) pairwise-ish rather than as a product, for CI's budget; jax
0.10.2 and 0.11.0 run OLDER_JAX_CASES.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.collectives import not_async, ragged
from jax_overlap._src.collectives.primitives import collective_start_p
from jax_overlap._src.patterns.moe import ragged_exchange
from jax_overlap._src.patterns.moe.layout import dispatch_layout

import lowered

NEWEST = not jax.__version__.startswith(("0.10.", "0.11."))
T, D = 8, 8          # tokens per device, model width

# (axis size, E_local, k, chunks, capacity, mode)
CASES = [
    (1, 2, 2, 2, "none", "jit"),
    (2, 1, 1, 4, "tight", "jit"),
    (2, 2, 2, 1, "large", "checkpoint"),
    (4, 1, 2, 2, "tight", "checkpoint"),
    (4, 2, 1, 4, "none", "jit"),
    (8, 1, 2, 4, "large", "jit"),
    (8, 2, 1, 2, "tight", "jit"),
    (8, 2, 2, 2, "none", "checkpoint"),
]
OLDER_JAX_CASES = [CASES[1], CASES[2]]   # axis size 8 and dropless: fresh_process_test


def _mesh(n):
  return jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def expert(p, tokens):
  return jnp.tanh(tokens @ p["w"]) + p["b"]


def _inputs(n, experts_local, k, seed=0):
  """NumPy inputs (no eager jax ops to compile): global x, ids, weights,
  params, each device's block a slice of T rows (of E_local experts)."""
  E = n * experts_local
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n * T, D)).astype(np.float32)
  # Half the choices go to experts 0 and 1, so a tight capacity drops.
  ids = np.where(rng.uniform(size=(n * T, k)) < 0.5,
                 rng.integers(0, min(2, E), (n * T, k)),
                 rng.integers(0, E, (n * T, k))).astype(np.int32)
  weights = rng.uniform(size=(n * T, k)).astype(np.float32)
  params = {"w": (rng.normal(size=(E, D, D)) / np.sqrt(D)).astype(np.float32),
            "b": rng.normal(size=(E, D)).astype(np.float32)}
  return x, ids, weights, params


def _capacity(kind, k):
  return {"none": None, "large": T * k, "tight": 2}[kind]


def kept_by_the_rule(ids, n, capacity, experts):
  """[n*T, k] bool: (token, choice) pairs kept, and each device's drops.
  An id outside [0, experts) is dropped and takes no capacity."""
  ids = np.asarray(ids)
  kept = np.ones(ids.shape, bool)
  dropped = np.zeros(n, np.int32)
  for s in range(n):
    counts = {}
    for t in range(s * T, (s + 1) * T):
      for j in range(ids.shape[1]):
        e = int(ids[t, j])
        if not 0 <= e < experts:
          kept[t, j] = False
          dropped[s] += 1
          continue
        counts[e] = counts.get(e, 0) + 1
        if capacity is not None and counts[e] > capacity:
          kept[t, j] = False
          dropped[s] += 1
  return kept, dropped


def dense_reference(x, ids, weights, params, kept, dy):
  """y and the gradients of <dy, y> by hand in NumPy: every (token, choice)
  through its expert `tanh(x @ w_e) + b_e`, weighted, masked by `kept`."""
  w_e, b_e = params["w"][ids], params["b"][ids]          # [T, k, D, D], [T, k, D]
  h = np.tanh(np.einsum("td,tkde->tke", x, w_e))
  out = h + b_e
  scale = weights * kept                                  # [T, k]
  y = np.einsum("tk,tkd->td", scale, out)
  d_weights = np.einsum("td,tkd->tk", dy, out) * kept
  d_pre = scale[..., None] * dy[:, None, :] * (1 - h ** 2)   # [T, k, D]
  d_x = np.einsum("tke,tkde->td", d_pre, w_e)
  d_w = np.zeros_like(params["w"])
  d_b = np.zeros_like(params["b"])
  np.add.at(d_w, ids, np.einsum("td,tke->tkde", x, d_pre))
  np.add.at(d_b, ids, scale[..., None] * dy[:, None, :])
  return y, (d_x, d_weights, {"b": d_b, "w": d_w})


def ours(n, chunks, capacity, mode):
  def local(x, ids, weights, params):
    out = jo.expert_parallel(expert, x, ids, weights, params, axis="i",
                             capacity=capacity, chunks=chunks)
    return out if capacity is not None else (out, jnp.zeros((), jnp.int32))
  def f(x, ids, weights, params):
    y, dropped = local(x, ids, weights, params)
    return y, dropped[None]
  if mode == "checkpoint":
    f = jax.checkpoint(f)
  return jax.shard_map(f, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                       out_specs=(P("i"), P("i")))


@functools.cache
def _values_and_grads(n, chunks, capacity, mode):
  """jit of (y, dropped, (dx, dweights, dparams)) for cotangent dy: one
  compile per case, shared by the tests that use its shapes."""
  f = ours(n, chunks, capacity, mode)
  def run(x, ids, weights, params, dy):
    y, pull, aux = jax.vjp(lambda x, w, p: f(x, ids, w, p), x, weights,
                           params, has_aux=True)
    return y, aux, pull(dy)
  return jax.jit(run)


def _assert_close(got, want, rtol=2e-5, atol=2e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                               atol=atol)


def _case_params():
  for case in CASES:
    marks = []
    if case not in OLDER_JAX_CASES:
      marks.append(pytest.mark.newest_jax)
    yield pytest.param(*case, marks=marks,
                       id="n{}-el{}-k{}-c{}-{}-{}".format(*case))


@pytest.mark.parametrize("n, experts_local, k, chunks, capacity, mode",
                         list(_case_params()))
def test_values_drops_and_grads_equal_the_dense_reference(
    n, experts_local, k, chunks, capacity, mode):
  x, ids, weights, params = _inputs(n, experts_local, k)
  cap = _capacity(capacity, k)
  kept, dropped = kept_by_the_rule(ids, n, cap, n * experts_local)
  if capacity == "tight":
    assert dropped.sum() > 0, "the tight case must drop something"
  if capacity == "large":
    assert dropped.sum() == 0
  dy = np.random.default_rng(9).normal(size=x.shape).astype(np.float32)
  y, got_dropped, grads = _values_and_grads(n, chunks, cap, mode)(
      x, ids, weights, params, dy)
  want_y, want_grads = dense_reference(x, ids, weights, params, kept, dy)
  np.testing.assert_array_equal(np.asarray(got_dropped), dropped)
  _assert_close(y, want_y)
  _assert_close(grads, want_grads, rtol=1e-4, atol=1e-4)


@pytest.mark.newest_jax
def test_experts_over_one_axis_of_two():
  # Data x expert parallelism: tokens over ("data", "e"), experts over "e"
  # only (each data row holds a copy); the experts' gradients are summed
  # over "data" by the cast expert_parallel makes, as for any replicated
  # shard_map input.
  mesh = jax.make_mesh((2, 4), ("data", "e"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x, ids, weights, params = _inputs(8, 1, 2)     # 8 blocks of T tokens
  E = 4 * 2                                       # E_local = 2 on each "e"
  ids, params = ids % E, jax.tree.map(lambda a: a[:E], params)

  def local(x, ids, w, p):
    y, dropped = jo.expert_parallel(expert, x, ids, w, p, axis="e",
                                    capacity=3, chunks=2)
    return y, dropped[None]
  tokens = P(("data", "e"))
  f = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + (P("e"),),
                    out_specs=(tokens, tokens))
  dy = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)

  def run(x, w, p):
    y, pull, dropped = jax.vjp(lambda x, w, p: f(x, ids, w, p), x, w, p,
                               has_aux=True)
    return y, dropped, pull(dy)
  y, dropped, grads = jax.jit(run)(x, weights, params)
  kept, want_dropped = kept_by_the_rule(ids, 8, 3, E)
  want_y, want_grads = dense_reference(x, ids, weights, params, kept, dy)
  np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
  _assert_close(y, want_y)
  _assert_close(grads, want_grads, rtol=1e-4, atol=1e-4)


def test_traced_ids_out_of_range_are_dropped_and_counted():
  # A traced id cannot be checked at the call: it contributes 0 and, with a
  # capacity, counts as dropped (documented in expert_parallel). The shapes
  # (and compile) of CASES[1].
  n, experts_local, k, chunks, capacity, mode = CASES[1]
  x, ids, weights, params = _inputs(n, experts_local, k)
  ids = ids.copy()
  ids[0, 0], ids[T + 1, 0] = -1, n * experts_local   # one on each device
  cap = _capacity(capacity, k)
  kept, want_dropped = kept_by_the_rule(ids, n, cap, n * experts_local)
  dy = np.ones(x.shape, np.float32)
  y, dropped, grads = _values_and_grads(n, chunks, cap, mode)(
      x, ids, weights, params, dy)
  safe = np.where(kept, ids, 0)
  want_y, want_grads = dense_reference(x, safe, weights, params, kept, dy)
  np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
  assert not kept[0, 0] and not kept[T + 1, 0]
  _assert_close(y, want_y)
  _assert_close(grads, want_grads, rtol=1e-4, atol=1e-4)


# --- the overlap, in the traced program ---------------------------------------

CHUNKS = 4


def _overlap_case(n=4):
  x, ids, weights, params = _inputs(n, 1, 2)
  f = lambda x, w, p: ours(n, CHUNKS, 2, "jit")(x, ids, w, p)[0]
  grad = jax.grad(lambda x, w, p: jnp.sum(jnp.sin(f(x, w, p))), (0, 1, 2))
  return f, grad, (x, weights, params)


def test_every_exchange_but_the_first_and_last_is_in_flight_beside_the_experts():
  # A pass: chunk 0's dispatch, one exchange a step (chunk c+1's dispatch
  # and chunk c-1's combine in one all-to-all), the last chunk's combine.
  f, grad, args = _overlap_case()
  per_pass = CHUNKS + 2
  for fn, passes in ((f, 1), (grad, 2)):
    windows = lowered.future_windows(fn, *args)
    assert len(windows) == passes * per_pass, len(windows)
    for p in range(passes):
      own = windows[p * per_pass:(p + 1) * per_pass]
      # The experts' tanh (recomputed under jax.vjp in the backward pass).
      beside = ["tanh" in w for w in own]
      assert beside == [False] + [True] * CHUNKS + [False], beside
      # One exchange in flight at a time (TPU v5e takes no more).
      assert not any("collective_start" in w for w in own), own


def _sent_elements(fn, *args):
  """Elements each device sends in the traced program's collectives."""
  eqns = lowered.flat_eqns(jax.jit(fn).trace(*args).jaxpr)
  return sum(int(np.prod(eqn.invars[0].aval.shape)) for eqn in eqns
             if eqn.primitive is collective_start_p)


def test_chunks_split_the_slots_so_chunking_adds_no_traffic():
  # The chunks split each expert's capacity slots (chunk c sends slots
  # [c * C / m, (c + 1) * C / m)), so a pass sends what one exchange sends
  # whatever `chunks`: C = capacity slots an expert, out and back.
  # Splitting the tokens instead made each chunk hold up to
  # min(capacity, T / chunks * k) slots an expert: chunks times as many.
  # (Dropless sends the routed rows: test_dropless_sends_the_routed_rows_...)
  n, k, capacity = 2, 2, 4
  x, ids, weights, params = _inputs(n, 1, k)
  want = 2 * (n * 1) * capacity * D       # dispatch + combine, E = n experts
  for chunks in (1, 2):
    f = lambda x, w, p: ours(n, chunks, capacity, "jit")(x, ids, w, p)[0]
    assert _sent_elements(f, x, weights, params) == want, chunks


def test_outputs_of_another_dtype_travel_in_the_same_exchange():
  # The expert returns bfloat16 from float32 tokens: a step's one exchange
  # carries both dtypes (as bytes), forward and backward (a capacity that
  # drops nothing: dropless sends each leg by its own ragged exchange).
  n, k = 2, 2
  x, ids, weights, params = _inputs(n, 1, k)
  cast = lambda p, t: expert(p, t).astype(jnp.bfloat16)
  def local(x, ids, w, p):
    return jo.expert_parallel(cast, x, ids, w, p, axis="i", chunks=2,
                              capacity=T * k)[0]
  f = jax.shard_map(local, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                    out_specs=P("i"))
  dy = np.ones(x.shape, np.float32)
  y, pull = jax.vjp(lambda x, w, p: f(x, ids, w, p), x, weights, params)
  grads = jax.jit(pull)(dy)
  want_y, want_grads = dense_reference(x, ids, weights, params,
                                       np.ones(ids.shape, bool), dy)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), want_y, rtol=3e-2, atol=3e-2)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=5e-2, atol=5e-2)


def test_axis_size_one_sends_nothing():
  x, ids, weights, params = _inputs(1, 2, 2)
  f = lambda x, w, p: ours(1, 2, None, "jit")(x, ids, w, p)[0]
  assert lowered.future_windows(f, x, weights, params) == []


@pytest.mark.skipif(not NEWEST, reason="XLA:CPU keeps the written order of "
                    "an ordered body on jax 0.12 only (0.10.2 and 0.11.0 run "
                    "OptimizationBarrierExpander before scheduling)")
def test_compiled_cpu_schedule_keeps_the_written_order():
  f, grad, args = _overlap_case()
  order = lambda fn: lowered.scheduled_markers(
      jax.jit(fn).lower(*args).compile().as_text(), {"all-to-all", "tanh"})
  A, X = "all-to-all", "tanh"
  # dispatch 0 | exchange (dispatch c+1, combine c-1), experts c | ... |
  # combine 3 (XLA:CPU runs each all-to-all where it starts: it has no
  # async ones).
  one_pass = [A] + [A, X] * CHUNKS + [A]
  assert order(f) == one_pass, order(f)
  # The backward pass: the same schedule (the experts' forward, and its tanh,
  # recomputed under jax.vjp).
  assert order(grad) == one_pass * 2, order(grad)


# --- dropless: the routed rows only, by a ragged all-to-all ----------------------

def test_dropless_layout_sends_each_experts_routed_rows():
  # What a ragged exchange sends of chunk c to expert e: the kept pairs that
  # chose e, past the c * C_c of the chunks before, at most C_c; they are
  # the block's first slots. Dropless they add up to T * k rows (not the
  # E * T * k slots of the padded buffers); with a capacity, to the kept.
  _, ids, _, _ = _inputs(1, 4, 2)                  # T = 8, k = 2, E = 4
  experts, chunks, per = 4, 2, T * 2 // 2
  counts = np.bincount(ids.ravel(), minlength=experts)
  for capacity in (None, 3):
    kept = counts if capacity is None else np.minimum(counts, capacity)
    layout = jax.jit(functools.partial(
        dispatch_layout, experts=experts, chunks=chunks, capacity=capacity,
        per_expert=per))(ids)
    sent = np.asarray(layout.sent)
    want = np.clip(kept[None] - np.arange(chunks)[:, None] * per, 0, per)
    np.testing.assert_array_equal(sent, want)
    assert sent.sum() == (T * 2 if capacity is None else kept.sum())
    filled = np.asarray(layout.pair_in_slot).reshape(chunks, experts, per) < T * 2
    np.testing.assert_array_equal(filled, np.arange(per) < sent[..., None])


def _dropless_case(n=4, experts_local=2, k=2, chunks=2):
  x, ids, weights, params = _inputs(n, experts_local, k)
  f = lambda x, w, p: ours(n, chunks, None, "jit")(x, ids, w, p)[0]
  grad = jax.grad(lambda x, w, p: jnp.sum(jnp.sin(f(x, w, p))), (0, 1, 2))
  return x, ids, weights, params, f, grad


def test_dropless_is_a_ragged_all_to_all_on_gpu_and_tpu_and_dense_on_cpu():
  # One traced program: each chunk's dispatch and combine is a ragged
  # exchange (2 a chunk a pass), lowered per platform. For cuda / tpu (as an
  # ahead-of-time compile from this CPU process lowers it) the real
  # ragged_all_to_all, and the one dense all-to-all left is of the row
  # counts (int32); it is said once that it is synchronous. For CPU, which
  # cannot run one, dense all-to-alls and no ragged op.
  chunks = 2
  x, _, weights, params, f, grad = _dropless_case(chunks=chunks)
  for fn, passes in ((f, 1), (grad, 2)):
    traced = jax.jit(fn).trace(x, weights, params)
    names = [e.params["comm"].name for e in lowered.flat_eqns(traced.jaxpr)
             if e.primitive is collective_start_p]
    assert names == ["ragged_all_to_all"] * (2 * chunks * passes), names
  traced = jax.jit(grad).trace(x, weights, params)
  for platform in ("cuda", "tpu"):
    not_async._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      text = traced.lower(lowering_platforms=(platform,)).as_text()
    said = [str(w.message) for w in caught
            if issubclass(w.category, jo.CollectiveNotAsyncWarning)]
    assert len(said) == 1, said
    assert said[0].startswith(f"expert_parallel(capacity=None) on {platform}:")
    assert text.count("@ragged_all_to_all(") == 2 * chunks * 2
    dense = [l for l in text.splitlines() if "stablehlo.all_to_all" in l]
    assert len(dense) == 1 and re.search(r"-> tensor<[0-9x]*xi32>", dense[0]), dense
  not_async._warned.clear()
  with warnings.catch_warnings():
    warnings.simplefilter("error", jo.CollectiveNotAsyncWarning)
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "ragged_all_to_all" not in cpu and "stablehlo.all_to_all" in cpu


def test_dropless_offsets_place_each_row_where_the_real_ragged_op_writes_it(
    monkeypatch):
  # On CPU the dropless exchange is the padded all-to-all, which does not
  # read the offsets that GPU and TPU's real op gets. Run it instead as the
  # ragged future's offset-driven stand-in (collectives/ragged.py, which
  # writes chunk i where jax.lax.ragged_all_to_all would): values and
  # gradients still equal the reference, so the offsets and sizes the real
  # op is given place every row right, forward and backward.
  monkeypatch.setattr(
      ragged_exchange, "_by_padded_all_to_all",
      lambda n_rows, axis, per: ragged.by_dense_all_to_all(n_rows, axis, None))
  x, ids, weights, params, f, _ = _dropless_case(n=4, experts_local=2, k=2)
  dy = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)
  y, pull = jax.vjp(jax.jit(f), x, weights, params)
  want_y, want_grads = dense_reference(x, ids, weights, params,
                                       np.ones(ids.shape, bool), dy)
  _assert_close(y, want_y)
  _assert_close(jax.jit(pull)(dy), want_grads, rtol=1e-4, atol=1e-4)


# --- docs ---------------------------------------------------------------------

def test_closed_over_values_get_gradients_and_integer_leaves_float0():
  # expert_fn = s * (expert + shift), s closed over, shift an integer leaf
  # of expert_params: d(sum y)/ds is the sum of the unscaled y, x's
  # gradient s times the unscaled one, shift's a float0 zero.
  n, k = 2, 1
  x, ids, weights, params = _inputs(n, 1, k)
  shift = np.arange(n, dtype=np.int32)
  shifted = dict(params, b=params["b"] + shift[:, None])
  kept = np.ones(ids.shape, bool)
  dy = np.ones(x.shape, np.float32)
  want_y, (want_dx, _, _) = dense_reference(x, ids, weights, shifted, kept, dy)

  def loss(x, params, s):
    local = lambda x, ids, w, p: jo.expert_parallel(
        lambda q, t: s * (expert(q, t) + q["shift"]), x, ids, w, p, axis="i")
    return jnp.sum(jax.shard_map(local, mesh=_mesh(n), in_specs=(P("i"),) * 4,
                                 out_specs=P("i"))(x, ids, weights, params))
  dx, d_params, ds = jax.jit(jax.grad(loss, (0, 1, 2), allow_int=True))(
      x, dict(params, shift=shift), 3.0)
  np.testing.assert_allclose(float(ds), want_y.sum(), rtol=1e-4)
  _assert_close(dx, 3.0 * want_dx, rtol=1e-4, atol=1e-4)
  assert d_params["shift"].dtype == jax.dtypes.float0
