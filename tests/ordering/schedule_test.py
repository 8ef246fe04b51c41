"""The order the compiled program keeps, on every jax version.

`program_order` exists to fix the order the *compiled* program runs. These
tests read it where it is decided: the scheduled module of
`lower(...).compile().as_text()`, which lists each computation's
instructions in schedule order. For each body, the undecorated program
compiles to another order (checked first, so each test can fail), and the
ordered one to the written order, read independently from the traced
program. The lowered-text tests in program_order_test.py pin the contract;
these pin what it is for.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jax_overlap
from jax_overlap import program_order
from jax_overlap._src import _compat
from jax_overlap._src.xla import module_marks
from jax_overlap._src.xla import compiled_order

import lowered

MARKERS = set(lowered.MARKER_OF_PRIMITIVE.values())

X = jnp.ones((64, 64)) / 64
Y = jnp.linspace(0.0, 1.0, 64)
Z = jnp.linspace(1.0, 2.0, 64)


def unordered(f=None, **_):
  """Stands in for `program_order`: the same body, no ordering at all."""
  return (lambda g: g) if f is None else f


def independent(po):
  # XLA's own order runs the cheap sin and exp first.
  @po(enforce=True)
  def f(x, y, z):
    return jnp.tanh(x @ x), jnp.sin(y), jnp.exp(z)
  return f


def free_block_between_two_steps(po):
  @po(enforce=True)
  def f(x, y, z):
    a = jnp.tanh(x @ x)

    @po(enforce=False)
    def both(y, z):
      return jnp.sin(y), jnp.exp(z)
    b, c = both(y, z)
    return a, b, c, jnp.cos(z * 2.0)
  return f


def scan_body(po):
  # The sin is loop-invariant: left to itself XLA hoists it out of the loop.
  def f(x, y, z):
    @po(enforce=True)
    def step(c, _):
      return jnp.tanh(c @ c), jnp.sin(y) + z
    return lax.scan(step, x, None, length=3)
  return f


def backward_of_ordered_block(po):
  # Linear in what is differentiated (the coefficients are inputs, not
  # constants XLA could fold), so the backward block holds the transposes in
  # the reverse of the written order: the matmul's, then the flip's (XLA's
  # own order runs the cheap reverse first).
  @po(enforce=True)
  def f(x, y, z):
    c = lax.stop_gradient
    return (jnp.flip(y) * c(z)).sum() + jnp.tanh(z).sum() + (x @ c(x)).sum()
  return jax.grad(f, argnums=(0, 1, 2))


CASES = {f.__name__: f for f in (independent, free_block_between_two_steps,
                                 scan_body, backward_of_ordered_block)}


def _orders(fn):
  """(compiled order, written order) of the marker ops of `fn`."""
  jitted = jax.jit(fn)
  scheduled = lowered.scheduled_markers(
      jitted.lower(X, Y, Z).compile().as_text(), MARKERS)
  closed = jitted.trace(X, Y, Z).jaxpr
  n_out = len(_compat.open_jaxpr(closed).outvars)
  # What the lowering drops (an unused forward block) is not written order.
  live, _ = _compat.dce(closed, [True] * n_out)
  return scheduled, lowered.written_markers(live)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_schedule_keeps_written_order(case):
  plain_scheduled, plain_written = _orders(CASES[case](unordered))
  assert not lowered.follows(plain_scheduled, plain_written), (
      "premise: XLA's own schedule of the undecorated body differs from the "
      f"written order; got {plain_scheduled} for {plain_written}")
  scheduled, written = _orders(CASES[case](program_order))
  assert len(scheduled) >= 3, scheduled
  assert lowered.follows(scheduled, written), (scheduled, written)


def test_cpu_keeper_is_what_keeps_the_order_on_old_cpu_compilers():
  # Where XLA's CPU compiler drops barriers before scheduling, the order above
  # holds only because ordered modules are compiled with that pass disabled.
  fn = jax.jit(independent(program_order))
  text = fn.lower(X, Y, Z).as_text()
  assert module_marks.ORDERED_MODULE_ATTR in text or _compat.USE_HIJAX
  if not _compat.cpu_expands_barriers_before_scheduling():
    pytest.skip("this jaxlib's CPU compiler keeps barriers until after "
                "scheduling by itself (jax >= 0.12)")
  compiled = fn.lower(X, Y, Z).compile().as_text()
  assert "opt-barrier" in compiled
  # The same module compiled without our option: XLA's own order.
  plain = jax.jit(independent(unordered)).lower(X, Y, Z).compile().as_text()
  assert "opt-barrier" not in plain


def test_user_disabled_passes_are_kept(monkeypatch):
  if not _compat.cpu_expands_barriers_before_scheduling():
    pytest.skip("this jaxlib's CPU compiler keeps barriers by itself")
  fn = jax.jit(independent(program_order))
  compiled = fn.lower(X, Y, Z).compile(
      compiler_options={"xla_disable_hlo_passes": "algsimp"}).as_text()
  assert "opt-barrier" in compiled


def test_warns_once_where_the_order_cannot_be_kept(monkeypatch):
  if _compat.USE_HIJAX:
    pytest.skip("jax >= 0.12 lowers ordered blocks through lojax; its CPU "
                "compiler keeps barriers until scheduling")
  monkeypatch.setattr(compiled_order, "_CPU_KEEPER_INSTALLED", False)
  monkeypatch.setattr(compiled_order, "_warned", set())
  f = lambda x: program_order(lambda x: jnp.sin(x) * 2, enforce=True)(x)
  with pytest.warns(jax_overlap.OrderNotKeptWarning,
                    match="compiled CPU program may not keep the written order"):
    jax.jit(f).lower(Y)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.OrderNotKeptWarning)
    jax.jit(lambda x: f(x) + 1).lower(Y)   # once per process


@pytest.mark.skipif(_compat.ASYNC_CUSTOM_CALLS,
                    reason="jax >= 0.12 lowers a future's halves apart on GPU")
def test_old_jax_leaves_a_future_in_flight_on_gpu(monkeypatch):
  # jax < 0.12 for GPU: the start is the plain all-reduce, marked, and its
  # result goes through no barrier before the sin written after it (the
  # compiler's async conversion then puts the sin in its window;
  # tests/aot/ on the older jax checks the compiled schedule); nothing says
  # "back to back" any more.
  monkeypatch.setattr(compiled_order, "_warned", set())
  mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

  @program_order(enforce=True)
  def body(v):
    fut = jax_overlap.psum_start(v, "i")
    s = jnp.sin(v)
    return fut.done() + s
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("i"),
                            out_specs=jax.P("i")))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.OrderNotKeptWarning)
    text = f.trace(Y).lower(lowering_platforms=("cuda",)).as_text()
  assert module_marks.IN_FLIGHT_ATTR in text, text
  lines = text.splitlines()
  at = next(i for i, l in enumerate(lines) if "stablehlo.all_reduce" in l)
  result = re.compile(re.escape(lines[at].split("=")[0].strip()) + r"(?![\w#])")
  sine = next(i for i, l in enumerate(lines) if "stablehlo.sine" in l)
  fenced = next(i for i, l in enumerate(lines) if i > at
                and "optimization_barrier" in l and result.search(l))
  assert at < sine < fenced, "\n".join(lines[at:fenced + 1])


@pytest.mark.subprocess
def test_opting_out_warns_and_compiles_as_xla_would(tmp_path):
  # In a fresh process: the variable is read when jax_overlap is imported.
  import subprocess
  import sys
  code = (
      "import warnings, jax, jax.numpy as jnp\n"
      "warnings.simplefilter('always')\n"
      "from jax_overlap import program_order\n"
      "f = program_order(lambda x, y: (jnp.tanh(x @ x), jnp.sin(y)), enforce=True)\n"
      "with warnings.catch_warnings(record=True) as w:\n"
      "  text = jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones(8)).compile().as_text()\n"
      "print('opt-barrier' in text, [str(x.message)[:40] for x in w])\n")
  env = dict(__import__("os").environ, JAX_OVERLAP_KEEP_CPU_ORDER="0",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  kept, warned = out.stdout.strip().split(" ", 1)
  if _compat.USE_HIJAX:
    assert warned == "[]"          # jax >= 0.12 keeps the order by itself
  else:
    assert kept == "False"
    assert "program_order: jax" in warned
