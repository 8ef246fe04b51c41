"""The report and the measurement shaped like jax (issue 28):
`overlap_report(fn, hardware=..., schedule=...)(*args, **kwargs)` and
`measure(fn, steps=..., warmup=..., ...)(*args, **kwargs)` take the function
first and their own options apart from its arguments, as `jax.make_jaxpr`
does. The old forms, `inspect(fn, *args, ...)` and `measure(fn, *args, ...)`,
stay one release: the same reports, with a DeprecationWarning. Options are
checked at the call that takes them, before any argument is seen.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo

INSPECT_WARNING = (r"jax_overlap\.inspect\(fn, \*args, .*deprecated.*"
                   r"overlap_report\(fn, hardware=\.\.\., schedule=\.\.\.\)"
                   r"\(\*args\)")
MEASURE_WARNING = (r"jax_overlap\.measure\(fn, \*args, .*deprecated.*"
                   r"measure\(fn, steps=\.\.\., warmup=\.\.\.\)\(\*args\)")


def _mesh():
  return jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))


def _ordered_step():
  """An all-gather future with a matmul written inside its window."""
  @jax.shard_map(mesh=_mesh(), in_specs=(P("i"), P()), out_specs=P("i"))
  @jo.program_order(enforce=True)
  def step(w_shard, x):
    """The docstring of step."""
    fut = jo.all_gather_start(w_shard, "i", tiled=True)
    y = x @ x
    return (y @ fut.done())[:1]
  return step


def _psum_step(keyword="scale"):
  """A psum of a matmul, scaled by fn's keyword argument named `keyword`."""
  mesh = _mesh()

  def step(x, **kwargs):
    scale = kwargs.get(keyword, 1.0)
    return jax.shard_map(lambda v: jax.lax.psum(v @ v.T * scale, "i"),
                         mesh=mesh, in_specs=P("i"), out_specs=P())(x)
  return step


ARGS = jnp.ones((8, 8)), jnp.ones((8, 8))


# --- overlap_report ----------------------------------------------------------------

@pytest.mark.parametrize("options", [
    {}, {"schedule": "compiled"}, {"schedule": "written"},
    {"schedule": "written", "hardware": "tpu-v5e"}], ids=str)
def test_overlap_report_equals_the_deprecated_inspect(options):
  step = _ordered_step()
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    new = jo.overlap_report(step, **options)(*ARGS)
  with pytest.warns(DeprecationWarning, match=INSPECT_WARNING):
    old = jo.inspect(step, *ARGS, **options)
  assert new.to_dict() == old.to_dict()
  assert new.schedule == old.schedule == options.get("schedule", "written")


def test_overlap_report_passes_every_keyword_to_fn():
  # A keyword of fn named like an option is fn's: none is taken.
  f = _psum_step(keyword="schedule")
  report = jo.overlap_report(f, hardware="tpu-v5e")(jnp.ones((8, 4)),
                                                    schedule=2.0)
  assert [c.kind for c in report.collectives] == ["all-reduce"]
  assert report.hardware.name == "tpu-v5e"
  step = _psum_step()
  with pytest.warns(DeprecationWarning, match=INSPECT_WARNING):
    old = jo.inspect(step, jnp.ones((8, 4)), scale=2.0)
  new = jo.overlap_report(step)(jnp.ones((8, 4)), scale=2.0)
  assert new.to_dict() == old.to_dict()


def test_the_returned_function_keeps_fn_and_is_reusable():
  step = _ordered_step()
  report = jo.overlap_report(step)
  assert report.__name__ == step.__name__ == "step"
  assert report.__doc__ == step.__doc__ == "The docstring of step."
  assert report.__wrapped__ is step
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  small, wide = report(*ARGS), report(f32(16, 8), f32(16, 16))
  assert small.written[0].overlapped == ["dot_general f32[8,8]"]
  assert wide.written[0].overlapped == ["dot_general f32[16,16]"]
  assert report(*ARGS).to_dict() == small.to_dict()


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: jo.overlap_report(fn=42), TypeError,
     r"overlap_report\(fn=\.\.\.\) must be a function: .*got 42"),
    (lambda: jo.overlap_report(None), TypeError,
     r"overlap_report\(fn=\.\.\.\) must be a function"),
    (lambda: jo.overlap_report(_psum_step(), schedule="x"), ValueError,
     r"overlap_report\(schedule=\.\.\.\) must be 'compiled', 'written' or "
     r"None .*got 'x'"),
    (lambda: jo.overlap_report(_psum_step(), hardware="tpu-v99"),
     jo.HardwareProfileError, r"tpu-v99"),
    # The old form: fn's arguments are not overlap_report's.
    (lambda: jo.overlap_report(_psum_step(), jnp.ones((8, 4))), TypeError,
     r"positional argument"),
], ids=["fn=42", "fn=None", "schedule", "hardware", "args"])
def test_overlap_report_checks_its_options_at_its_own_call(call, error, pattern):
  # Raised before any argument of fn is given: no returned function exists.
  with pytest.raises(error, match=pattern):
    call()


def test_the_deprecated_inspect_names_itself_in_its_errors():
  with pytest.warns(DeprecationWarning, match=INSPECT_WARNING):
    with pytest.raises(TypeError, match=r"^inspect\(fn=\.\.\.\) must be"):
      jo.inspect(3, jnp.ones(4))
  with pytest.warns(DeprecationWarning, match=INSPECT_WARNING):
    with pytest.raises(ValueError, match=r"^inspect\(schedule=\.\.\.\)"):
      jo.inspect(_psum_step(), jnp.ones((8, 4)), schedule="fast")


def test_a_plain_function_of_a_non_array_names_it_at_the_returned_call():
  f = lambda x, n: x * n
  report = jo.overlap_report(f)      # nothing is traced yet
  with pytest.raises(TypeError, match=r"args\[1\] is a str"):
    report(jnp.ones(4), "three")


# --- measure ---------------------------------------------------------------------------

def _rows(report):
  """What two captures of one program share (times differ run to run)."""
  return sorted((r["name"], r["kind"], r["device"], r["runs"], r["where"],
                 repr(r["modelled"])) for r in report.to_dict()["measured"])


def test_measure_new_form_equals_the_deprecated_one(tmp_path):
  step = _psum_step()
  x = jnp.ones((8, 4))
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    run = jo.measure(step, steps=2, warmup=0, hardware="tpu-v5e",
                     profile_dir=tmp_path / "new")
    assert not (tmp_path / "new").exists()     # nothing ran yet
    new = run(x, scale=2.0)
  with pytest.warns(DeprecationWarning, match=MEASURE_WARNING):
    old = jo.measure(step, x, steps=2, warmup=0, hardware="tpu-v5e",
                     profile_dir=tmp_path / "old", scale=2.0)
  assert _rows(new) == _rows(old)
  assert [r[1] for r in _rows(new)] == ["all-reduce", "all-reduce"]
  assert {r[3] for r in _rows(new)} == {2}
  assert list((tmp_path / "new").rglob("*.xplane.pb"))
  assert list((tmp_path / "old").rglob("*.xplane.pb"))


def test_measure_returns_a_reusable_function_keeping_fn():
  step = jax.jit(_psum_step())
  run = jo.measure(step, steps=1, warmup=0)
  assert callable(run) and not isinstance(run, jo.MeasuredReport)
  assert run.__name__ == step.__name__ and run.__wrapped__ is step
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    small, big = run(jnp.ones((8, 4))), run(jnp.ones((16, 8)))
  assert {r.runs for r in small.measured} == {r.runs for r in big.measured} == {1}
  assert len(small.measured) == len(big.measured) == 2


def test_measure_fn_keyword_named_like_an_option_needs_the_new_form():
  # `steps` here is fn's own argument: the new form hands it to fn.
  f = _psum_step(keyword="steps")
  report = jo.measure(f, steps=1, warmup=0)(jnp.ones((8, 4)), steps=3.0)
  assert {r.runs for r in report.measured} == {1}
  # Keywords that are not measure's alone (no positional argument) are fn's
  # too: the deprecated form, run at once.
  g = _psum_step()
  with pytest.warns(DeprecationWarning, match=MEASURE_WARNING):
    with pytest.raises(TypeError, match=r"scale|keyword|positional"):
      jo.measure(g, steps=1, warmup=0, scale=2.0)   # x missing: fn's error


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: jo.measure(fn=42), TypeError,
     r"measure\(fn=\.\.\.\) must be a function: .*got 42"),
    (lambda: jo.measure(_psum_step(), steps=0), ValueError,
     r"measure\(steps=\.\.\.\) must be an int >= 1 .*got 0"),
    (lambda: jo.measure(_psum_step(), warmup=-1), ValueError,
     r"measure\(warmup=\.\.\.\) must be an int >= 0 .*got -1"),
    (lambda: jo.measure(_psum_step(), steps=True), ValueError,
     r"measure\(steps=\.\.\.\) must be an int >= 1 .*got True"),
    (lambda: jo.measure(_psum_step(), hardware="tpu-v99"),
     jo.HardwareProfileError, r"tpu-v99"),
], ids=["fn=42", "steps", "warmup", "steps=True", "hardware"])
def test_measure_checks_its_options_at_its_own_call(call, error, pattern):
  with pytest.raises(error, match=pattern):
    call()


# --- the public names ------------------------------------------------------------------

def test_overlap_report_is_public_and_inspect_is_out_of_all():
  assert "overlap_report" in jo.__all__ and "measure" in jo.__all__
  assert "inspect" not in jo.__all__      # kept as an attribute, one release
  namespace = {}
  exec("import inspect\nfrom jax_overlap import *", namespace)  # noqa: S102
  assert namespace["inspect"].__name__ == "inspect"   # the standard library's
  assert namespace["overlap_report"] is jo.overlap_report
  assert "overlap_report(fn, hardware=..., schedule=...)" in jo.inspect.__doc__
