"""`jax_overlap.inspect` on live CPU compiles of programs with our futures.

CPU compiles every collective blocking, so the compiled report
(`schedule="compiled"`) must say so and give the windows as written in the
traced program beside it. The written schedule is tested in
`inspect_written_schedule_test.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.inspection.reading import live
from jax_overlap._src.inspection.model import xla_cost
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text


def _mesh(n):
  kwargs = {}
  if hasattr(jax.sharding, "AxisType"):
    kwargs["axis_types"] = (jax.sharding.AxisType.Auto,)
  return jax.make_mesh((n,), ("d",), **kwargs)


def _prefetch_layer(mesh):
  """start; a matmul written while it runs; done - in an ordered block."""
  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P("d"))
  @jo.program_order(enforce=True)
  def layer(x, w, w_next_shard):
    fut = jo.all_gather_start(w_next_shard, "d", tiled=True)
    y = jnp.tanh(x @ w)
    return y @ fut.done().T
  return layer


ARGS = (jnp.ones((64, 32)), jnp.ones((32, 32)), jnp.ones((64, 32)))


def test_cpu_makes_the_pair_blocking_and_the_written_window_is_reported():
  report = jo.overlap_report(_prefetch_layer(_mesh(8)),
                             schedule="compiled")(*ARGS)
  (c,) = report.collectives
  assert (c.kind, c.is_async, c.made_blocking, c.overlapped) == (
      "all-gather", False, True, [])
  assert c.start == c.done and c.bytes == 64 * 32 * 4 and c.group_size == 8
  assert c.flags[0] == "made blocking by the backend"
  assert c.exposed_s == pytest.approx(c.comm_s)
  (w,) = report.written
  assert (w.collective, w.kind, w.bytes, w.group_size) == (
      "all_gather", "all-gather", 64 * 32 * 4, 8)
  # The matmul written between start and done, with its shape.
  assert w.overlapped == ["dot_general f32[8,32]"]
  assert "inspect_live_test.py" in w.where
  assert w.compute_s > 0 and w.exposed_s == pytest.approx(
      max(0.0, w.comm_s - w.compute_s))
  assert any("blocking" in n for n in report.notes)
  assert any("traced program" in n for n in report.notes)
  assert report.source.startswith("live compile of ") and "on cpu" in \
      report.source
  d = report.to_dict()
  assert d["written"][0]["overlapped"] == ["dot_general f32[8,32]"]
  assert d["collectives"][0]["async"] is False


FUTURES = {
    "all_gather": (lambda v: jo.all_gather_start(v, "d", tiled=True),
                   P("d"), "all-gather", (16, 4)),
    "psum": (lambda v: jo.psum_start(v, "d"), P(), "all-reduce", (8, 4)),
    "psum_scatter": (lambda v: jo.psum_scatter_start(v, "d", tiled=True),
                     P("d"), "reduce-scatter", (4, 4)),
    "all_to_all": (lambda v: jo.all_to_all_start(v, "d", 0, 0, tiled=True),
                   P("d"), "all-to-all", (8, 4)),
    "ppermute": (lambda v: jo.ppermute_start(v, "d", [(0, 1), (1, 0)]),
                 P("d"), "collective-permute", (8, 4)),
}


@pytest.mark.parametrize("name", list(FUTURES))
def test_every_future_kind(name):
  start, out_spec, kind, out_shape = FUTURES[name]
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P()), out_specs=out_spec)
  @jo.program_order(enforce=True)
  def f(x, w):
    fut = start(x)
    y = w @ w
    return fut.done() + y[0, 0]

  report = jo.overlap_report(f, schedule="compiled")(jnp.ones((16, 4)),
                                                     jnp.ones((4, 4)))
  (c,) = [c for c in report.collectives if c.kind == kind]
  assert c.made_blocking and not c.is_async
  (w,) = report.written
  assert (w.collective, w.kind, w.group_size) == (name, kind, 2)
  assert w.bytes == out_shape[0] * out_shape[1] * 4
  assert w.overlapped == ["dot_general f32[4,4]"]


def test_a_plain_collective_is_blocking_but_not_made_so():
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P())
  def f(x):
    return jax.lax.psum(x, "d")

  report = jo.overlap_report(f)(jnp.ones((8, 4)))
  (c,) = report.collectives
  assert (c.kind, c.is_async, c.made_blocking) == ("all-reduce", False, False)
  assert c.flags[0] == "blocking"
  assert report.written == []


def test_a_future_in_a_scan_body():
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
  def f(xs, w):
    def body(carry, x):
      fut = jo.psum_start(x, "d")
      carry = carry @ w
      return carry + fut.done()[0, 0], None
    return jax.lax.scan(body, w, xs)[0]

  report = jo.overlap_report(f, schedule="compiled")(jnp.ones((8, 4, 4)),
                                                     jnp.ones((4, 4)))
  (c,) = report.collectives
  assert c.kind == "all-reduce" and c.made_blocking
  assert (c.trip_count, c.runs) == (4, 4)
  assert c.loop is not None and c.computation != "main"
  (w,) = report.written
  assert w.loop == "scan x4" and w.overlapped == ["dot_general f32[4,4]"]


def test_hardware_and_keyword_arguments():
  mesh = _mesh(2)

  def f(x, *, scale):
    return jax.shard_map(lambda v: jax.lax.psum(v * scale, "d"), mesh=mesh,
                         in_specs=P("d"), out_specs=P())(x)

  report = jo.overlap_report(f, hardware="tpu-v5e")(jnp.ones((8,)), scale=2.0)
  assert report.hardware.name == "tpu-v5e"
  assert report.collectives[0].group_size == 2


def test_schedule_comes_from_xla_module_object():
  compiled = jax.jit(_prefetch_layer(_mesh(8))).lower(*ARGS).compile()
  module, obj = live.compiled_module(compiled)
  if obj is None:
    pytest.skip("this jaxlib offers no runtime_executable().hlo_modules(); "
                "the text of compiled.as_text() is read instead")
  from_text = parse_hlo_text(compiled.as_text())
  for name, comp in from_text.computations.items():
    assert sorted(i.name for i in module.computations[name].instructions) \
        == sorted(i.name for i in comp.instructions)
  entry_order = [i.name for i in module.entry.instructions]
  assert entry_order == [i.name for i in obj.schedule().sequence(
      next(c for c in obj.computations() if c.name == module.entry.name))]


def test_xla_cost_analysis_of_one_instruction():
  mesh = _mesh(8)
  compiled = jax.jit(_prefetch_layer(mesh)).lower(*ARGS).compile()
  module, obj = live.compiled_module(compiled)
  costs = xla_cost.XlaCosts(module, jax.devices()[0].client)
  if not costs.available:
    pytest.skip("this jaxlib lacks hlo_module_from_text or "
                "hlo_module_cost_analysis; shapes are used instead")
  entry = module.entry
  # The first matmul: f32[8,32] @ f32[32,32] on each device.
  dots = [i for i in entry.instructions if i.opcode == "fusion"
          and any(s.opcode == "dot" for c in i.callees()
                  for s in module.computations[c].instructions)]
  flops = sorted(costs(i, entry)[0] for i in dots)
  assert flops == [2 * 8 * 32 * 32, 2 * 8 * 32 * 64]
  report = jo.overlap_report(_prefetch_layer(mesh), schedule="compiled")(*ARGS)
  assert report.cost_source == xla_cost.LABEL


def test_a_jitted_function_keeps_its_static_arguments():
  mesh = _mesh(2)
  psum = jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
                       in_specs=P("d"), out_specs=P())

  def f(x, times):
    for _ in range(times):
      x = psum(x)
    return x

  report = jo.overlap_report(jax.jit(f, static_argnums=1))(jnp.ones((8,)), 3)
  assert [c.kind for c in report.collectives] == ["all-reduce"] * 3
