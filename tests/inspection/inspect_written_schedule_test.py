"""The written schedule: the traced program's order, modelled as if kept.

CPU compiles every collective blocking, so `jax_overlap.inspect` models the
program as written there when it has futures. These tests pin what that
model says: a future hides behind the compute written before its done, a
jax.lax collective does not, an `fsdp_scan` training step exposes only what
has nothing to hide behind, and loops run their trip count.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.patterns.fsdp import use_order

H100 = resolve_hardware("h100")
AXIS = "d"
SOURCE = pathlib.Path(__file__).read_text().splitlines()


def _line_of(text: str) -> str:
  """`file:line` of the one line of this file ending with `text`."""
  (k,) = [k for k, line in enumerate(SOURCE, 1) if line.endswith(text)]
  return f"{__file__}:{k}"


def _mesh(n):
  kwargs = {}
  if hasattr(jax.sharding, "AxisType"):
    kwargs["axis_types"] = (jax.sharding.AxisType.Auto,)
  return jax.make_mesh((n,), (AXIS,), **kwargs)


def _sds(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


# The model's formulas, from the profile's own figures (docs/overlap-report.md).
def _dot_seconds(m, k, n):
  flops, nbytes = 2 * m * k * n, 4 * (m * k + k * n + m * n)
  return max(flops / (H100.peak_tflops * 1e12),
             nbytes / (H100.hbm_gbytes_per_s * 1e9))


def _gather_seconds(nbytes, n):
  return (H100.collective_latency_us * 1e-6
          + (n - 1) / n * nbytes / (H100.interconnect_gbytes_per_s * 1e9))


# --- one future, one matmul -------------------------------------------------------

K = 1024


def _prefetch(mesh, asynchronous: bool):
  """Gather the next weight while a matmul runs, in an ordered block."""
  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=P(AXIS))
  @jo.program_order(enforce=True)
  def step(w_shard, x, v):
    if asynchronous:
      fut = jo.all_gather_start(w_shard, AXIS, tiled=True)  # the future
      y = x @ v
      w = fut.done()
    else:
      w = lax.all_gather(w_shard, AXIS, tiled=True)  # the synchronous one
      y = x @ v
    return (y @ w)[:1]
  return step


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("rows", [256, 16384], ids=["comm>compute",
                                                   "compute>comm"])
def test_a_future_hides_behind_the_matmul_written_inside(n, rows):
  args = (_sds(K, K), _sds(rows, K), _sds(K, K))
  report = jo.overlap_report(_prefetch(_mesh(n), True), hardware="h100",
                             schedule="written")(*args)
  assert report.schedule == "written"
  (c,) = report.collectives
  assert (c.kind, c.is_async, c.made_blocking, c.group_size, c.bytes) == (
      "all-gather", True, False, n, K * K * 4)
  assert c.overlapped == ["dot_general.1"] and c.runs == 1
  comm, compute = _gather_seconds(K * K * 4, n), _dot_seconds(rows, K, K)
  assert c.comm_s == pytest.approx(comm, rel=1e-12)
  assert c.exposed_s == pytest.approx(max(0.0, comm - compute), rel=1e-9,
                                      abs=1e-15)
  assert (c.exposed_s > 0) == (rows == 256)
  assert report.totals["exposed_s"] == pytest.approx(c.exposed_s, abs=1e-15)
  # The window as written says the same of this one future.
  (w,) = report.written
  assert w.exposed_s == pytest.approx(c.exposed_s, abs=1e-15)
  assert c.where == _line_of("# the future")


@pytest.mark.parametrize("n", [2, 8])
def test_a_synchronous_all_gather_is_all_exposed(n):
  args = (_sds(K, K), _sds(16384, K), _sds(K, K))
  report = jo.overlap_report(_prefetch(_mesh(n), False), hardware="h100",
                             schedule="written")(*args)
  (c,) = report.collectives
  assert (c.kind, c.is_async, c.group_size) == ("all-gather", False, n)
  assert c.flags[0] == "blocking" and c.start == c.done
  assert c.where == _line_of("# the synchronous one")
  assert c.comm_s == pytest.approx(_gather_seconds(K * K * 4, n), rel=1e-12)
  assert c.exposed_s == pytest.approx(c.comm_s, rel=1e-12)
  assert report.written == []


# --- an fsdp_scan training step -----------------------------------------------------

# Per device: a batch of 16384 rows and two 1024 x 1024 float32 weights a
# layer (4 MiB each once gathered over 8 devices). On h100 a layer's forward
# is 2 matmuls of 34.7 us of flops (40 us of HBM traffic) each, its
# backward twice that, while gathering (or reduce-scattering) one weight
# takes 10 us + 7/8 * 4 MiB / 450 GB/s = 18.2 us: every layer's compute
# hides its two transfers, and in the backward pass its four.
BATCH, D, H = 16384, 1024, 1024


def _mlp_layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def _training_step(n_layers, fsdp: bool):
  mesh = _mesh(8)
  specs = {"w1": P(None, AXIS), "w2": P(None, AXIS)}

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), specs), out_specs=P())
  def loss(x, params):
    if fsdp:
      y = jo.fsdp_scan(_mlp_layer, x, params, axis=AXIS)
    else:
      def body(x, w):
        full = jax.tree.map(
            lambda a: lax.all_gather(a, AXIS, axis=0, tiled=True), w)
        return _mlp_layer(x, full), None
      y, _ = lax.scan(body, x, params)
    return lax.psum(jnp.sum(y ** 2), AXIS)

  params = {"w1": _sds(n_layers, D, H), "w2": _sds(n_layers, H, D)}
  return jax.value_and_grad(loss, argnums=1), (_sds(8 * BATCH, D), params)


@pytest.fixture(scope="module")
def layer_0_whole():
  """These tests model fsdp_scan's loops with layer 0 moved whole, one
  bucket like every other layer; the split of layer 0 by use order (the
  default) has its own tests (tests/patterns/fsdp/fsdp_split_ends_test.py)."""
  with use_order.layer_0_whole():
    yield


@pytest.fixture(scope="module")
def fsdp_reports(layer_0_whole):
  reports = {}
  for layers in (4, 8):
    step, args = _training_step(layers, fsdp=True)
    reports[layers] = jo.overlap_report(step, schedule="written")(*args)
  return reports


def test_fsdp_step_exposes_only_what_has_nothing_to_hide_behind(fsdp_reports):
  layers = 8
  report = fsdp_reports[layers]
  kinds = sorted({c.kind for c in report.collectives})
  assert kinds == ["all-gather", "all-reduce", "reduce-scatter"]
  # The forward's first gather, the last reduce-scatter and the loss's psum
  # overlap nothing; everything else is hidden. (A layer's two weights
  # travel in one bucket, fsdp_scan's default: one gather and one
  # reduce-scatter per layer; and the backward pass starts with the last
  # layer's gathered weights kept from the forward pass, the default
  # reshard_after_forward=1, so it has no bare first gather.)
  bare = [c for c in report.collectives if "overlaps nothing" in c.flags]
  assert sorted(c.kind for c in bare) == (
      ["all-gather"] + ["all-reduce"] + ["reduce-scatter"])
  for c in report.collectives:
    if c not in bare:
      assert c.is_async and c.overlapped and c.exposed_s == pytest.approx(
          0.0, abs=1e-15), c
  t = report.totals
  assert t["exposed_s"] == pytest.approx(sum(c.comm_s for c in bare),
                                         rel=1e-9)
  # The bound: a layer moves 3 transfers of one size (its bucket gathered
  # forward, gathered again backward, reduce-scattered; the last layer 2),
  # and 2 of the 3 * layers - 1 have nothing to hide behind, so at most
  # 1/layers of the layers' traffic is exposed, plus the loss's psum.
  (psum,) = [c for c in report.collectives if c.kind == "all-reduce"]
  assert psum.flags[0] == "blocking"
  assert 0 < t["exposed_s"] <= (t["comm_s"] - psum.comm_s) / layers \
      + psum.comm_s + 1e-12
  assert t["exposed_s"] < 0.15 * t["comm_s"]
  assert t["bound_exposed_s"] <= t["exposed_s"]


def test_fsdp_loops_run_their_trip_count(fsdp_reports):
  # One layer a loop iteration (fsdp_scan's default unroll), layer 0 whole
  # (the fixture), the last layer folded into the loops (fsdp_plan's
  # `again`): the forward loop runs layers 0..L-1, L trips, the backward loop
  # layers L-1..1, L-1 trips (layer 0's backward runs apart). Each body's
  # collectives run that many times.
  for layers, report in fsdp_reports.items():
    looped = [c for c in report.collectives if c.loop is not None]
    assert sorted({(c.runs, c.trip_count) for c in looped}) == [
        (layers - 1, layers - 1), (layers, layers)]
    assert all(c.computation.endswith("_body") for c in looped)
  # 4 more layers: 4 * 3 more transfers (one bucket each), each as long as
  # any other.
  gather = next(c for c in fsdp_reports[8].collectives
                if c.kind == "all-gather").comm_s
  grew = fsdp_reports[8].totals["comm_s"] - fsdp_reports[4].totals["comm_s"]
  assert grew == pytest.approx(4 * 3 * gather, rel=1e-9)
  assert fsdp_reports[8].compute_s > 1.9 * fsdp_reports[4].compute_s


def test_fsdp_forward_alone_runs_inside_its_custom_vjp(layer_0_whole):
  # Without autodiff the traced program keeps fsdp_scan's custom_vjp call,
  # which is modelled inline: the forward pass, its first gather bare (one
  # bucket a layer).
  layers = 6
  mesh = _mesh(8)
  specs = {"w1": P(None, AXIS), "w2": P(None, AXIS)}

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), specs), out_specs=P(AXIS))
  def model(x, params):
    return jo.fsdp_scan(_mlp_layer, x, params, axis=AXIS)

  params = {"w1": _sds(layers, D, H), "w2": _sds(layers, H, D)}
  report = jo.overlap_report(model, schedule="written")(_sds(8 * BATCH, D),
                                                        params)
  assert {c.kind for c in report.collectives} == {"all-gather"}
  bare = [c for c in report.collectives if "overlaps nothing" in c.flags]
  assert len(bare) == 1 and all(c.runs == 1 for c in bare)
  assert report.totals["exposed_s"] == pytest.approx(
      sum(c.comm_s for c in bare), rel=1e-9)
  assert sum(c.runs for c in report.collectives) == layers


def test_plain_scan_with_synchronous_gathers_exposes_everything():
  layers = 8
  step, args = _training_step(layers, fsdp=False)
  report = jo.overlap_report(step, schedule="written")(*args)
  assert {c.kind for c in report.collectives} == {
      "all-gather", "all-reduce", "reduce-scatter"}
  assert all(not c.is_async for c in report.collectives)
  assert report.totals["exposed_s"] == pytest.approx(
      report.totals["comm_s"], rel=1e-12)
  gathers = [c for c in report.collectives if c.kind == "all-gather"]
  assert [c.runs for c in gathers] == [layers, layers]
  assert report.written == []


# --- which schedule, and where it is said ---------------------------------------------

def _small_prefetch():
  args = (jnp.ones((32, 32)), jnp.ones((8, 32)), jnp.ones((32, 32)))
  step = _prefetch(_mesh(8), True)
  return step, args


def test_default_on_cpu_is_the_written_schedule_when_there_are_futures():
  if jax.default_backend() != "cpu":
    pytest.skip("the default differs where the backend keeps async pairs")
  step, args = _small_prefetch()
  report = jo.overlap_report(step)(*args)
  assert report.schedule == "written"
  assert report.collectives[0].is_async
  assert report.collectives[0].overlapped == ["dot_general.1"]
  assert any("cpu backend made 1 collective(s) blocking" in n
             for n in report.notes)
  assert any("schedule as written" in n for n in report.notes)
  assert report.cost_source == "shapes in the traced program"
  assert report.source.startswith("traced program of ")
  data = json.loads(report.to_json())
  assert data["schedule"] == "written"
  assert data["written"][0]["overlapped"] == ["dot_general f32[8,32]"]

  compiled = jo.overlap_report(step, schedule="compiled")(*args)
  assert compiled.schedule == "compiled"
  assert compiled.to_dict()["schedule"] == "compiled"
  (c,) = compiled.collectives
  assert c.made_blocking and not c.is_async and c.overlapped == []
  assert compiled.written[0].overlapped == ["dot_general f32[8,32]"]
  assert not any("schedule as written" in n for n in compiled.notes)


def test_default_without_futures_is_the_compiled_schedule():
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=P(AXIS), out_specs=P())
  def f(x):
    return lax.psum(x, AXIS)

  report = jo.overlap_report(f)(jnp.ones((8, 4)))
  assert report.schedule == "compiled"
  assert report.collectives[0].flags[0] == "blocking"


def test_table_timeline_and_trace_say_which_schedule(tmp_path):
  step, args = _small_prefetch()
  report = jo.overlap_report(step, schedule="written")(*args)
  text = report.table()     # str() is the summary now
  assert "Collectives in the written schedule (times modelled on h100" in text
  assert "Totals of the written schedule, modelled on h100" in text
  assert "in the written schedule; times modelled on h100" in str(
      report)
  assert "OverlapReport('traced program of step', written schedule" in repr(
      report)
  report.save_trace(tmp_path / "trace.json")
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert trace["otherData"]["schedule"] == "written"
  rows = [e["args"]["name"] for e in trace["traceEvents"]
          if e["name"] == "thread_name"]
  assert rows[0] == "compute" and "all-gather all_gather_start.1" in rows
  assert trace["traceEvents"][0]["args"]["name"].startswith(
      "written schedule, modelled on h100")
  pytest.importorskip("matplotlib", reason="matplotlib (the 'report' extra) "
                                           "is not installed")
  report.save_timeline(tmp_path / "written.png")
  assert (tmp_path / "written.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_schedule_is_refused():
  step, _ = _small_prefetch()
  with pytest.raises(ValueError, match=r"overlap_report\(schedule=...\) must "
                     r"be 'compiled', 'written' or None .*got 'as written'"):
    jo.overlap_report(step, schedule="as written")   # at once, before args


# --- control flow ---------------------------------------------------------------------

def test_a_cond_is_modelled_by_its_costliest_branch():
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=P(AXIS))
  @jo.program_order(enforce=True)
  def step(w_shard, x, flag):
    fut = jo.all_gather_start(w_shard, AXIS, tiled=True)
    y = lax.cond(flag > 0, lambda x: x @ x, lambda x: x + 1.0, x)
    return y[:1] + fut.done()[:1]

  report = jo.overlap_report(step, schedule="written")(_sds(K, K), _sds(K, K),
                                                       _sds())
  (c,) = report.collectives
  assert "dot_general.1" in c.overlapped and "add.1" not in c.overlapped
  assert any("has 2 branches; the costliest (branch 1) is modelled" in n
             for n in report.notes)


def test_calls_run_inline_and_long_scans_cost_three_iterations():
  # A future started outside a checkpointed, jitted function and finished
  # after it: the matmul inside hides it. The scan of 100 iterations is
  # modelled by its steady state: 3 iterations of events, 100 runs.
  mesh = _mesh(2)
  trip = 100

  @jax.checkpoint
  @jax.jit
  def inner(x):
    return jax.nn.relu(x @ x)

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
  def f(w_shard, x):
    fut = jo.all_gather_start(w_shard, AXIS, tiled=True)
    y = inner(x)
    w = fut.done()

    def body(y, _):
      g = jo.psum_start(y, AXIS)
      y = inner(y)
      return y + g.done(), None

    y, _ = lax.scan(body, y, None, length=trip)
    return (y @ w)[:1]

  report = jo.overlap_report(f, schedule="written")(_sds(K, K), _sds(K, K))
  gather, psum = report.collectives
  assert gather.overlapped[0] == "dot_general.1" and gather.runs == 1
  assert (psum.kind, psum.runs, psum.trip_count) == ("all-reduce", trip, trip)
  matmuls = [e for e in report.timeline.events
             if e.category == "compute" and e.name.startswith("dot_general")]
  assert len(matmuls) == 1 + 3 + 1   # before, 3 iterations drawn, after
  (repeat,) = [e for e in report.timeline.events if e.category == "loop"]
  assert repeat.name.endswith(f"{trip - 3} more iterations like the last")
  assert report.compute_s > (trip + 2) * _dot_seconds(K, K, K)


def test_a_while_loop_of_unknown_trip_count_runs_once():
  mesh = _mesh(2)

  @jax.shard_map(mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
  def f(x, n):
    def body(carry):
      i, y = carry
      return i + 1, lax.psum(y, AXIS) * y
    return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

  report = jo.overlap_report(f, schedule="written")(
      _sds(8, 4), jax.ShapeDtypeStruct((), jnp.int32))
  (c,) = report.collectives
  assert (c.kind, c.runs, c.trip_count) == ("all-reduce", 1, None)
  assert "trip count unknown (modelled as 1)" in c.flags


@pytest.mark.skipif(not (hasattr(lax, "psum_scatter_start")
                         and hasattr(lax, "pcast")),
                    reason="this jax has no public async psum_scatter")
def test_a_future_carried_across_scan_iterations():
  # jax's own async collectives can ride in a scan carry: started in one
  # iteration and finished in the next, as a pipelined loop does.
  mesh = _mesh(2)
  trip = 5

  @jax.shard_map(mesh=mesh, in_specs=(P(), P()), out_specs=P(AXIS))
  def f(ws, x):
    fut = lax.psum_scatter_start(ws[0], AXIS, tiled=True)

    def body(carry, w):
      x, fut = carry
      x = x @ x + fut.done().sum()
      return (x, lax.psum_scatter_start(w, AXIS, tiled=True)), None

    x = lax.pcast(x, (AXIS,), to="varying")
    (x, fut), _ = lax.scan(body, (x, fut), ws[1:])
    return x + fut.done().sum()

  report = jo.overlap_report(f, schedule="written")(_sds(trip + 1, 64, 64),
                                                    _sds(64, 64))
  got = [(c.kind, c.computation == "main", c.runs, c.spans_iteration)
         for c in report.collectives]
  assert got == [("reduce-scatter", True, 1, True),     # before -> first
                 ("reduce-scatter", False, trip - 1, True),  # i -> i+1
                 ("reduce-scatter", False, 1, True)]    # last -> after
  # The matmul of each iteration is written between a start and its done.
  assert all("dot_general.1" in c.overlapped for c in report.collectives[:2])
