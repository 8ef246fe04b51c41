"""program_order: where barriers go, on every supported jax."""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap import program_order
from jax_overlap._src import _compat

import lowered

try:  # jax >= 0.12 ships the reference implementation.
  from jax.experimental.overlap import program_order as reference_program_order
except ImportError:
  reference_program_order = None

needs_reference = pytest.mark.skipif(
    reference_program_order is None,
    reason="this jax has no jax.experimental.overlap.program_order to compare to")
needs_lojax = pytest.mark.skipif(
    not lowered.HAS_LOJAX,
    reason="this jax's Traced has no lojax stage; barriers are checked in StableHLO")


X = jnp.arange(8.0)
Y = jnp.arange(8.0) * 2.0
Z = jnp.arange(8.0) * 3.0


# --- bodies, written once and ordered with either implementation ---------------

def plain(x, y):
  a = jnp.sin(x)
  b = jnp.cos(y)
  return a * b


def with_dead_code(x, y):
  a = jnp.sin(x)
  _ = jnp.cos(x)
  b = jnp.exp(y)
  return a, b


def with_nullary(x, y):
  a = jnp.sin(x)
  i = jnp.arange(8.0)
  b = jnp.cos(y)
  return a + i, b


def with_literals(x):
  a = x * 2.0
  return a + 3.0


def free_blocks(po):
  def f(x, a, b):
    x = jnp.sin(x)

    @po(enforce=False)
    def op1(x):
      return x + 1.0

    @po(enforce=False)
    def op2(y, a, b):
      return y * a + b
    return op2(op1(x), a, b)
  return f


def excluded(po):
  def f(x, w):
    @po(enforce=False)
    def op1(x):
      return x + 1.0
    y = op1(x)

    @po(enforce=False, exclude_argnames="w")
    def op2(w):
      return y * w
    return op2(w)
  return f


def jit_calls(x, a, b):
  x = jnp.sin(x)
  y = jax.jit(lambda x: x + 1.0)(x)
  return jax.jit(lambda y, a, b: y * a + b)(y, a, b)


def nested(po):
  def f(x, w):
    x = jnp.exp(x)
    w = jnp.exp(w)

    @po(enforce=False)
    def op1(x):
      x = jnp.cos(jnp.sin(x))

      @po(enforce=True)
      def inner(x):
        return (x + 1.0) * 2.0
      return inner(x)
    y = op1(x)

    @po(enforce=False, exclude_argnames="w")
    def op2(w):
      @po(enforce=True)
      def inner(w):
        return y * w + 3.0
      return inner(w)
    return op2(w)
  return f


def _takes_po(body):
  return body in (free_blocks, excluded, nested)


# name: (body, decorator kwargs, args, StableHLO barriers, lojax create_tokens)
CASES = {
    "plain": (plain, dict(enforce=True), (X, Y), 2, 0),
    "dead_code": (with_dead_code, dict(enforce=True), (X, Y), 1, 0),
    "nullary": (with_nullary, dict(enforce=True), (X, Y), 3, 1),
    "literals": (with_literals, dict(enforce=True), (X,), 1, 0),
    "free_blocks": (free_blocks, dict(enforce=True), (X, Y, Z), 4, 2),
    "excluded": (excluded, dict(enforce=True), (X, Y), 1, 1),
    "jit_calls": (jit_calls, dict(enforce=True), (X, Y, Z), 4, 2),
    "nested": (nested, dict(enforce=True), (X, Y), 6, 2),
    "strict": (plain, dict(enforce=True, strict_in_out=True), (X, Y), 4, 0),
    "strict_in": (plain, dict(enforce=True, strict_in_out=(True, False)), (X, Y), 3, 0),
    "strict_out": (plain, dict(enforce=True, strict_in_out=(False, True)), (X, Y), 3, 0),
    "free_only": (plain, dict(enforce=False), (X, Y), 0, 0),
}


def build(name, po=program_order):
  body, kwargs, args, _, _ = CASES[name]
  fn = body(po) if _takes_po(body) else body
  return po(fn, **kwargs), fn, args


@pytest.mark.parametrize("name", sorted(CASES))
def test_barrier_counts_in_stablehlo(name):
  ordered, _, args = build(name)
  text = lowered.stablehlo(ordered, *args)
  assert text.count("stablehlo.optimization_barrier") == CASES[name][3]
  assert "program_order" not in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_jaxpr_holds_one_equation_and_no_barrier(name):
  ordered, _, args = build(name)
  jaxpr = lowered.traced_jaxpr(ordered, *args)
  assert [e.primitive.name for e in _compat.open_jaxpr(jaxpr).eqns] == ["program_order"]
  assert "optimization_barrier" not in str(jaxpr)


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_equal_unordered(name):
  ordered, fn, args = build(name)
  unordered = fn if not _takes_po(CASES[name][0]) else CASES[name][0](
      lambda f=None, **_: (lambda g: g) if f is None else f)
  # Different programs may fuse differently (XLA's CPU sin/cos differ in the
  # last bit inside and outside a fusion), hence one ulp of tolerance.
  for got, want in zip(jax.tree.leaves(jax.jit(ordered)(*args)),
                       jax.tree.leaves(jax.jit(unordered)(*args))):
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
  for got, want in zip(jax.tree.leaves(ordered(*args)),
                       jax.tree.leaves(unordered(*args))):
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


@needs_lojax
@pytest.mark.parametrize("name", sorted(CASES))
def test_lojax_counts(name):
  ordered, _, args = build(name)
  lo = lowered.lojax_jaxpr(ordered, *args)
  assert lowered.count_in_jaxpr(lo, "optimization_barrier") == CASES[name][3]
  assert lowered.count_in_jaxpr(lo, "create_token") == CASES[name][4]


@needs_reference
@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_match_jax_reference(name):
  ours, _, args = build(name)
  ref, _, _ = build(name, po=reference_program_order)
  for stage in (lowered.lojax_jaxpr, lambda f, *a: lowered.stablehlo(f, *a)):
    got, want = str(stage(ours, *args)), str(stage(ref, *args))
    for op in ("optimization_barrier", "create_token"):
      assert got.count(op) == want.count(op), (op, got, want)


# --- where the barriers sit -------------------------------------------------------

def _main_ops(text):
  main = text.split("func.func public @main", 1)[1].split("\n  }", 1)[0]
  return re.findall(r"= stablehlo\.(\w+)|\bcall @(\w+)", main)


def _op_names(text):
  return [a or b for a, b in _main_ops(text)]


def test_order_in_stablehlo_follows_the_body():
  ordered, _, args = build("plain")
  ops = [op for op in _op_names(lowered.stablehlo(ordered, *args))
         if op in ("sine", "cosine", "multiply", "optimization_barrier")]
  assert ops == ["sine", "optimization_barrier", "cosine",
                 "optimization_barrier", "multiply"]


def test_dead_equation_gets_no_barrier():
  ordered, _, args = build("dead_code")
  text = lowered.stablehlo(ordered, *args)
  assert "cosine" not in text
  ops = [op for op in _op_names(text) if op != "constant"]
  assert ops == ["sine", "optimization_barrier", "exponential"]


def test_unused_output_is_dead_code_too():
  f = program_order(with_dead_code, enforce=True)

  def g(x, y):
    a, _ = f(x, y)
    return a
  text = lowered.stablehlo(g, X, Y)
  assert "exponential" not in text
  assert text.count("stablehlo.optimization_barrier") == 0


def test_literals_never_go_through_a_barrier():
  ordered, _, args = build("literals")
  text = lowered.stablehlo(ordered, *args)
  barrier = next(l for l in text.splitlines() if "optimization_barrier" in l)
  # One operand: the product; the literal 3.0 is not fenced.
  assert re.search(r"optimization_barrier %\w+ :", barrier), barrier


def test_nullary_equation_waits_for_a_token():
  ordered, _, args = build("nullary")
  text = lowered.stablehlo(ordered, *args)
  main = _op_names(text)
  # sin, then a barrier tying sin's output to the token, then the iota's call.
  assert main.index("sine") < main.index("optimization_barrier")
  iota_call = re.search(r"call @after_token\(%\w+#1\)", text)
  assert iota_call, text
  assert 'inlineable = "xla_late"' in text


def _barriers(text):
  """{result name: operand names} of each optimization_barrier in `text`."""
  return {m.group(1): re.findall(r"%[\w#]+", m.group(2)) for m in re.finditer(
      r"(%\w+)(?::\d+)? = stablehlo\.optimization_barrier ([^:]*):", text)}


def test_equation_after_a_nullary_one_is_fenced_after_the_one_before():
  # The iota's call waits for sin through a token, but XLA inlines the call
  # and the token goes with it: cos, the next equation, must then still be
  # fenced after sin, so its barrier takes sin's output too. (Without that,
  # a ring's block matmul after a send and an input-free cast of a literal
  # ran before the send started on TPU v5p, tests/aot/.)
  ordered, _, args = build("nullary")
  text = lowered.stablehlo(ordered, *args)
  barriers = _barriers(text)
  sine = re.search(r"(%\w+) = stablehlo\.sine ", text).group(1)
  after_sine = [name for name, ops in barriers.items() if sine in ops]
  assert len(after_sine) == 1, text
  cosine_in = re.search(r"stablehlo\.cosine (%\w+)#", text).group(1)
  assert any(op.startswith(after_sine[0] + "#") for op in barriers[cosine_in]), text


def test_strict_in_out_fences_first_and_last():
  ordered, _, args = build("strict")
  ops = [op for op in _op_names(lowered.stablehlo(ordered, *args))
         if op != "constant"]
  assert ops[0] == "optimization_barrier"
  assert ops[-1] == "optimization_barrier"


def test_free_block_orders_nothing_inside():
  f = program_order(enforce=False)(with_dead_code)
  assert lowered.stablehlo(f, X, Y).count("optimization_barrier") == 0


def test_enforced_block_in_free_block_orders_its_own_body():
  @program_order(enforce=False)
  def f(x, y):
    return program_order(plain, enforce=True)(x, y) + jnp.tanh(y)
  assert lowered.stablehlo(f, X, Y).count("optimization_barrier") == 2


def test_jit_deduplication_survives():
  @program_order(enforce=True)
  def step(x):
    return jnp.sin(x) + jnp.cos(x)

  @jax.jit
  def layer(x):
    r = jnp.remainder(jnp.arange(x.shape[0], dtype=jnp.int32), 2)
    return step(x) + r.astype(x.dtype)

  def model(x, tokens):
    x = layer(x)
    r = jnp.remainder(jnp.ones((4,), dtype=jnp.int32), 2)
    return x.sum() + jnp.roll(tokens, r[0]).sum().astype(x.dtype)

  text = lowered.stablehlo(model, jnp.ones((8,)), jnp.arange(16, dtype=jnp.int32))
  where = [l for l in text.splitlines() if "func.func private @_where" in l]
  assert len(where) == 1, where


# --- the decorator ---------------------------------------------------------------

def test_pytrees_and_keyword_arguments():
  @program_order(enforce=True)
  def f(params, x, *, scale):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return {"out": h * scale, "aux": (h.sum(), [x])}

  params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
  x = jnp.ones((2, 8))
  got = jax.jit(f)(params, x, scale=2.0)
  want = f.__wrapped__(params, x, scale=2.0)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_call_form_and_wraps():
  f = program_order(plain, enforce=True)
  assert f.__name__ == "plain"
  np.testing.assert_array_equal(jax.jit(f)(X, Y), plain(X, Y))


def test_exclude_argnames_by_keyword_and_position():
  @program_order(enforce=True)
  def f(x, w):
    y = jnp.sin(x)

    @program_order(enforce=False, exclude_argnames=("w",))
    def op(y, w):
      return y * w
    return op(y, w=w), op(y, w)
  a, b = jax.jit(f)(X, Y)
  np.testing.assert_array_equal(a, b)
  # sin -> op: 1 token barrier (y comes from sin, w is excluded);
  # op -> op: 1 token barrier + 1 for y, which the first op did not make.
  text = lowered.stablehlo(f, X, Y)
  barriers = [l for l in text.splitlines() if "optimization_barrier" in l]
  assert len(barriers) == 3
  assert not any("%arg1" in l for l in barriers)  # w is never fenced


def test_closed_over_tracer_is_an_input():
  def g(x, w):
    y = jnp.sin(x)

    @program_order(enforce=True)
    def h(w):
      return y * w + 1.0
    return h(w)
  np.testing.assert_allclose(jax.jit(g)(X, Y), jnp.sin(X) * Y + 1.0)


class TestErrors:

  def test_enforce_required(self):
    with pytest.raises(TypeError, match="requires the keyword argument `enforce`"):
      program_order(plain)
    with pytest.raises(TypeError, match="requires the keyword argument `enforce`"):
      program_order()

  def test_enforce_must_be_bool(self):
    with pytest.raises(TypeError, match="must be True or False, got 'yes'"):
      program_order(enforce="yes")

  def test_exclude_argnames_with_enforce(self):
    with pytest.raises(ValueError,
                       match="exclude_argnames cannot be used with enforce=True"):
      program_order(enforce=True, exclude_argnames=("x",))

  def test_strict_in_out_with_free_block(self):
    with pytest.raises(ValueError,
                       match="strict_in_out=True cannot be used with enforce=False"):
      program_order(enforce=False, strict_in_out=True)

  def test_unknown_argname_lists_parameters(self):
    with pytest.raises(ValueError, match=r"names \['v'\].*parameters are \['x', 'w'\]"):
      program_order(lambda x, w: x * w, enforce=False, exclude_argnames="v")

  def test_bad_strict_in_out(self):
    with pytest.raises(TypeError, match="pair of bools"):
      program_order(enforce=True, strict_in_out=(True,))

  def test_not_callable(self):
    with pytest.raises(TypeError, match="expects a function"):
      program_order(3, enforce=True)


# --- no retracing, no recompiling ---------------------------------------------------

class _CompileLog(logging.Handler):

  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _compiles(fn):
  handler = _CompileLog()
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  old = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)
  try:
    fn()
  finally:
    jax.config.update("jax_log_compiles", old)
    logger.removeHandler(handler)
  return [m for m in handler.messages if "ompiling" in m]


@pytest.mark.parametrize("under_jit", [False, True])
def test_second_call_neither_traces_nor_compiles(under_jit):
  traces = []

  @program_order(enforce=True)
  def f(x, y):
    traces.append(1)
    return jnp.sin(x) * jnp.cos(y)

  g = jax.jit(f) if under_jit else f
  x, y = jnp.arange(5.0), jnp.ones(5)
  jax.block_until_ready(g(x, y))
  assert len(traces) == 1
  x2 = x + 1.0
  again = _compiles(lambda: jax.block_until_ready(g(x2, y)))
  assert len(traces) == 1
  assert again == []


def test_shard_map_body_keeps_each_operand_type():
  # A barrier tying a device-varying value to an invariant one must not make
  # the invariant one varying: a later pvary of it would then fail.
  mesh = jax.make_mesh((8,), ("d",))
  P = jax.sharding.PartitionSpec

  @program_order(enforce=True)
  def step(x, w):
    h = jnp.tanh(x * 2.0)
    return h * jax.lax.psum(w, "d")

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P()),
                            out_specs=P("d")))
  x = jax.device_put(jnp.arange(16.0), jax.sharding.NamedSharding(mesh, P("d")))
  w = jax.device_put(jnp.ones(2), jax.sharding.NamedSharding(mesh, P()))
  np.testing.assert_allclose(f(x, w), jnp.tanh(x * 2.0) * 8.0, rtol=1e-6)
  assert lowered.stablehlo(f, x, w).count("stablehlo.optimization_barrier") >= 2


def test_axis_index_after_another_step_compiles_in_shard_map():
  # An input-free equation after another one is fenced as a late-inlined call
  # on a token; with `axis_index` inside, XLA's SPMD partitioner refused the
  # call's partition-id (jax 0.12), so it is computed in place.
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((8,), ("t",), axis_types=(jax.sharding.AxisType.Auto,))

  @program_order(enforce=True)
  def body(x):
    y = jnp.sin(x)
    return y + jax.lax.axis_index("t")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("t"), out_specs=P("t")))
  x = jnp.ones((8, 2))
  np.testing.assert_allclose(f(x), np.sin(x) + np.arange(8.0)[:, None], rtol=1e-6)
