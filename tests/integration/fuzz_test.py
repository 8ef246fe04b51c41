"""Differential fuzzing: random programs against two oracles.

Each random program (tests/integration/fuzz_programs.py) runs twice: with
`program_order` and our futures, and with the decorator replaced by the
identity and each future by the synchronous `jax.lax` collective. They must
agree on values, `jax.grad`, `jax.jvp` and `saved_residuals`; the traced
program must hold no barrier, and the lowered one exactly the barriers the
README's contract gives (counted independently from the traced jaxpr). On
jax 0.12 the lowered barrier and token counts must also equal those of jax's
own `jax.experimental.overlap.program_order` on the same program, and where
jax's own refuses a program, ours must run it.

CI runs a fixed, derandomized budget per jax version (a CI failure
reproduces); `make fuzz N=...` runs N random programs on the newest jax
(JAX_OVERLAP_FUZZ_EXAMPLES=N, random seeds; hypothesis prints how to
reproduce a failure; JAX_OVERLAP_FUZZ_SHRINK=0 shows it unshrunk, at once).
Each failure found becomes a named test in
tests/integration/fuzz_regressions_test.py.
"""

from __future__ import annotations

import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, reject, settings
from hypothesis.errors import InvalidArgument
from jax import lax
from jax._src import config as jax_config
from jax._src.ad_checkpoint import saved_residuals

import fuzz_programs as fp
import lowered

try:  # jax >= 0.12 ships the reference implementation.
  from jax.experimental.overlap import program_order as jax_program_order
except ImportError:
  jax_program_order = None

_N = int(os.environ.get("JAX_OVERLAP_FUZZ_EXAMPLES", "0"))
# A file each program is written to before it is compiled: if XLA takes the
# process down, the last program in it is the one.
_LOG = os.environ.get("JAX_OVERLAP_FUZZ_LOG")


def fuzz_settings(ci_examples: int):
  """CI: `ci_examples` programs, the same on every run (derandomized), about
  a minute per jax version on 2 cores. JAX_OVERLAP_FUZZ_EXAMPLES=N: N new
  random programs."""
  phases = None
  if os.environ.get("JAX_OVERLAP_FUZZ_SHRINK") == "0":  # the failure as found
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
  return settings(
      phases=phases or list(Phase),
      max_examples=_N or ci_examples, derandomize=not _N, database=None,
      deadline=None, print_blob=True,
      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _barrier_takes_tokens() -> bool:
  """Whether this jax lowers tokens as tokens (0.10.2 uses a bool instead)."""
  try:
    jax.jit(lambda: lax.optimization_barrier(lax.create_token())).lower()
    return True
  except Exception:  # noqa: BLE001 - any failure means "no"
    return False


TOKENS_VISIBLE = _barrier_takes_tokens()

# jax 0.10.2 and 0.11.0 inline an ordered body's jax_remat3 calls before
# placing barriers, which then fence their equations one by one instead of
# the call as one step (xfail in tests/integration/fuzz_regressions_test.py). There the
# counts of remat3 programs are not compared; everything else is.
REMAT3_COUNTS_FOLLOW_CONTRACT = lowered.HAS_LOJAX


def note(what: str):
  """A hypothesis event (statistics: --hypothesis-show-statistics)."""
  try:
    event(what)
  except InvalidArgument:  # a regression test, not under @given
    pass


# --- the programs under test --------------------------------------------------------

def _weights(x):
  return jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * 0.37)


def derivatives(fn, n_inputs):
  """One function returning fn's values, gradient, jvp, linearized jvp and
  a Hessian-vector product (jvp of the gradient)."""
  def loss(*xs):
    return sum(jnp.sum(o * _weights(o)) for o in fn(*xs))
  grad = jax.grad(loss, argnums=tuple(range(n_inputs)))

  def all_of_it(*xs):
    tangents = tuple(_weights(x) + 0.5 for x in xs)
    _, jvp_out = jax.jvp(fn, xs, tangents)
    _, lin = jax.linearize(fn, *xs)
    _, hvp = jax.jvp(grad, xs, tangents)
    return fn(*xs), grad(*xs), jvp_out, lin(*tangents), hvp
  return all_of_it


def _remat3(program):
  return jax_config.remat3(program.remat3)


def traced_barriers(jaxpr) -> int:
  """`optimization_barrier` equations anywhere in a traced jaxpr."""
  return str(jaxpr).count("optimization_barrier")


def saved_residual_types(fn, xs):
  """Saved residuals' types. Single values are left out: without
  program_order jax also saves a scalar literal of the body's (float32[1]
  out of a shard_map), which an ordered body keeps inside its backward block
  (see transformations_test)."""
  return sorted(str(aval) for aval, _ in saved_residuals(fn, *xs)
                if aval.size > 1)


def _bucket(n: int) -> str:
  return "0" if n == 0 else "1-9" if n < 10 else "10-99" if n < 100 else "100+"


def assert_same(got, want, exact, what):
  """Bit for bit where `exact`, else within float tolerance (a few ulps,
  grown by the program's depth, relative to each array's scale)."""
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for k, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, k, a.shape, b.shape)
    if exact:
      np.testing.assert_array_equal(a, b, err_msg=f"{what}[{k}]")
    else:
      scale = float(np.nanmax(np.abs(b), initial=1.0)) if b.size else 1.0
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, scale),
                                 err_msg=f"{what}[{k}]")


# --- the checks, shared with fuzz_regressions_test.py ---------------------------------

def _both(program):
  """Ours and the plain program, and the inputs."""
  xs = fp.inputs(program)
  ours = fp.build(program)
  plain = fp.build(program, po=fp.identity_decorator, futures=False)
  return ours, plain, xs


def _plain(run):
  """`run()` on the plain program. Where jax itself fails on it (jax 0.10.2's
  jax_remat3 inside shard_map: "pvary is a invariant->variant collective")
  there is nothing to compare with: the example is rejected."""
  try:
    return run()
  except Exception as e:  # noqa: BLE001
    note(f"plain program fails in jax: {type(e).__name__}")
    reject()


def check_traced_like_unordered(program: fp.Program):
  """Tracing and lowering only: no barrier in the traced program, exactly
  the contract's in the lowered one, the plain program's saved residuals."""
  ours, plain, xs = _both(program)
  n = len(xs)
  with _remat3(program):
    traced_plain = _plain(lambda: jax.jit(derivatives(plain, n)).trace(*xs))
    traced = jax.jit(derivatives(ours, n)).trace(*xs)
    # No barrier while tracing: autodiff and remat saw the plain program.
    # (jax_remat3 makes barriers of its own, in both programs; on jax 0.10.2
    # and 0.11.0 the plain program also keeps some around dead code that
    # ours drops.)
    if program.remat3:
      assert traced_barriers(traced.jaxpr) <= traced_barriers(traced_plain.jaxpr)
    else:
      assert traced_barriers(traced.jaxpr) == 0
    try:
      lowered_text = traced.lower().as_text()
    except Exception:
      # Where jax cannot lower the plain program either (jax 0.11.0's
      # jax_remat3 inside shard_map: "sub requires varying manual axes to
      # match"), there is nothing to compare with.
      _plain(lambda: traced_plain.lower())
      raise
    got = fp.stablehlo_counts(lowered_text)
    want = fp.contract_counts(traced.jaxpr)
    note(f"barriers: {_bucket(got.barriers)}")
    if program.remat3 and not REMAT3_COUNTS_FOLLOW_CONTRACT:
      note("counts not compared: jax_remat3 on jax < 0.12")
    else:
      assert got.barriers == want.barriers, (got, want)
      if TOKENS_VISIBLE:
        assert got.tokens == want.tokens, (got, want)
    if fp.returns_a_value_again(program):
      note("residuals not compared: a block returns an input or a value twice")
    else:
      want = _plain(lambda: saved_residual_types(plain, xs))
      got = saved_residual_types(ours, xs)
      if program.remat3 and got != want:
        # jax_remat3 keeps a checkpoint's unread inputs alive in the
        # undecorated program (and saves their tangents' residuals); inside
        # an ordered body they are dead code. Ours may save fewer, never
        # more (tests/integration/fuzz_regressions_test.py).
        assert not Counter(got) - Counter(want), (got, want)
        note("remat3: ours saves fewer residuals")
      else:
        assert got == want


def _log(program):
  if _LOG:
    with open(_LOG, "w") as f:
      f.write(repr(program) + "\n")


def check_computes_like_unordered(program: fp.Program):
  """Compiled and run: values, gradient, jvp, linearize and hvp."""
  _log(program)
  ours, plain, xs = _both(program)
  n = len(xs)
  with _remat3(program):
    want = _plain(lambda: jax.jit(derivatives(plain, n))(*xs))
    got = jax.jit(derivatives(ours, n))(*xs)
  # Values and jvps: the same ops in the same order, so bit for bit where
  # no op's result depends on fusion (fp.is_exact); gradients sum cotangents
  # in an order blocks may change, so always within tolerance.
  exact = fp.is_exact(program)
  note("exact program" if exact else "inexact program")
  if fp.has_futures(program):
    note("futures")
  assert_same(got[0], want[0], exact, "values")
  assert_same(got[2], want[2], exact, "jvp")
  assert_same(got[3], want[3], exact, "linearize")
  assert_same(got[1], want[1], False, "grad")
  assert_same(got[4], want[4], False, "hvp")


def check_against_unordered(program: fp.Program):
  """Both of the above."""
  check_traced_like_unordered(program)
  check_computes_like_unordered(program)


def check_against_jax(program: fp.Program):
  """On jax >= 0.12: the same barrier and token counts as jax's own
  program_order, or, where jax's own refuses the program, ours runs it."""
  _log(program)
  xs = fp.inputs(program)
  n = len(xs)
  ours = jax.jit(derivatives(fp.build(program), n))
  theirs = jax.jit(derivatives(fp.build(program, po=jax_program_order), n))
  with _remat3(program):
    ours_traced = ours.trace(*xs)
    ours_lowered = ours_traced.lower()
    try:
      # Lowered only: compiling jax's own may crash the process (jax-facts).
      theirs_text = theirs.lower(*xs).as_text()
    except Exception as e:  # noqa: BLE001 - jax's own refused: ours must run it
      note(f"jax's own program_order refused: {type(e).__name__}")
      theirs_text = None
    if theirs_text is None:
      _, plain, _ = _both(program)
      want = _plain(lambda: jax.jit(derivatives(plain, n))(*xs))
      got = ours_lowered.compile()(*xs)
      assert_same(got, want, False, "values and derivatives")
      return
  note("counts compared with jax's own program_order")
  got = fp.stablehlo_counts(ours_lowered.as_text())
  want = fp.stablehlo_counts(theirs_text)
  # The one known difference (tests/integration/fuzz_regressions_test.py, xfail): a step
  # whose B has only literal inputs gets a token from ours, none from jax's.
  want += fp.Counts(0, fp.literal_fed_steps(ours_traced.jaxpr))
  if got != want and _fewer_in_derivatives_only(program, xs, got, want,
                                                ours_traced):
    return
  assert got == want, (got, want)


def _fewer_in_derivatives_only(program, xs, got, want, ours_traced) -> bool:
  """Where jax's own lowers more barriers than ours in the derivatives only.

  A block whose outputs do not depend on the inputs has symbolic-zero
  tangents: ours passes them on, so the block's jvp is dead code and gets no
  barrier (the contract's first rule); jax's own instantiates the zeros and
  lowers the block (tests/integration/fuzz_regressions_test.py). Accepted when the
  undifferentiated program's counts are equal to jax's own and ours follow
  the contract."""
  if not (got.barriers < want.barriers and got.tokens <= want.tokens):
    return False
  if got != fp.contract_counts(ours_traced.jaxpr):
    return False
  with _remat3(program):
    ours = jax.jit(fp.build(program)).lower(*xs).as_text()
    theirs = jax.jit(fp.build(program, po=jax_program_order)).lower(*xs).as_text()
  if fp.stablehlo_counts(ours).barriers != fp.stablehlo_counts(theirs).barriers:
    return False
  note("jax's own lowers more barriers in derivatives (symbolic-zero tangents)")
  return True


# --- the property tests ------------------------------------------------------------------

@fuzz_settings(ci_examples=60)
@given(fp.programs())
def test_random_program_traces_and_lowers_by_contract(program):
  check_traced_like_unordered(program)


@fuzz_settings(ci_examples=40)
@given(fp.programs())
def test_random_program_computes_like_unordered(program):
  check_computes_like_unordered(program)


@pytest.mark.skipif(jax_program_order is None,
                    reason="this jax has no jax.experimental.overlap.program_order")
@fuzz_settings(ci_examples=30)
@given(fp.programs(futures=False))
def test_random_program_matches_jax_program_order(program):
  check_against_jax(program)
