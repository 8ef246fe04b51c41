"""Measured overlap from a profile: `jax_overlap.measure` and `jax-overlap profile`.

One real CPU capture (8 devices, 3 steps) is shared by the tests that need it;
no test asserts a measured time there (scheduler noise on 2 cores). GPU-shaped
profiles are built here as XSpace text protos with known intervals, and their
results are checked exactly. A public MI300 capture checks that a real GPU
profile parses.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.cli.main import main
from jax_overlap._src.inspection.measured import classify, intervals, wire
from jax_overlap._src.inspection.measured.hlo_proto import running_jaxlib
from jax_overlap._src.inspection.measured.xplane import read_space

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "profiles"
COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = \S.*? "
    r"(all-gather|all-reduce|collective-permute|reduce-scatter|all-to-all)\(", re.M)


def _mesh(n):
  kwargs = {}
  if hasattr(jax.sharding, "AxisType"):
    kwargs["axis_types"] = (jax.sharding.AxisType.Auto,)
  return jax.make_mesh((n,), ("x",), **kwargs)


def _step(mesh):
  n = mesh.shape["x"]

  def body(w, x):
    w_full = jax.lax.all_gather(w, "x", tiled=True)
    y = jax.lax.psum(x @ w_full, "x")
    return jax.lax.ppermute(y, "x", [(i, (i + 1) % n) for i in range(n)])
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                               out_specs=P("x")))


@pytest.fixture(scope="module")
def cpu_capture(tmp_path_factory):
  """(report, compiled text, profile dir) of one 3-step CPU capture."""
  step = _step(_mesh(8))
  args = jnp.ones((16, 16)), jnp.ones((16, 16))
  where = tmp_path_factory.mktemp("profile")
  report = jo.measure(step, steps=3, profile_dir=where)(*args)
  return report, step.lower(*args).compile().as_text(), where


def test_cpu_capture_finds_every_collective_once_per_device(cpu_capture):
  report, text, _ = cpu_capture
  compiled = dict((name, kind) for name, kind in COLLECTIVE.findall(text))
  assert len(compiled) == 3, text
  measured = report.to_dict()["measured"]
  got = sorted((r["name"], r["kind"], r["device"]) for r in measured)
  assert got == sorted((name, kind, d) for name, kind in compiled.items()
                       for d in range(8))
  for r in measured:
    assert r["runs"] == 3, r
    assert r["hidden_s"] == 0.0 and r["exposed_s"] == r["measured_s"] > 0, r
    assert any(f.startswith("blocking on this backend") for f in r["flags"]), r
    assert r["modelled"]["kind"] == r["kind"], r
  totals = report.to_dict()["measured_totals"]
  assert sorted(totals) == [str(d) for d in range(8)]
  assert all(t["hidden_s"] == 0.0 and t["overlap_fraction"] == 0.0
             for t in totals.values())
  assert report.backend == "cpu" and report.steps == 3
  assert any("nothing ran beside any, so hidden_s is 0" in n for n in report.notes)
  assert "blocking on this backend" in str(report)


def test_cli_reads_the_same_capture(cpu_capture, tmp_path, capsys):
  report, _, where = cpu_capture
  png, trace = tmp_path / "t.png", tmp_path / "t.json"
  args = ["profile", str(where), "--json", "--trace", str(trace)]
  try:
    import matplotlib  # noqa: F401
    args += ["--timeline", str(png)]
  except ImportError:
    png = None
  assert main(args) == 0
  out = json.loads(capsys.readouterr().out)
  names = {(r["name"], r["device"], r["runs"]) for r in out["measured"]}
  assert names == {(r.name, r.device, r.runs) for r in report.measured}
  events = json.loads(trace.read_text())["traceEvents"]
  assert {e["pid"] for e in events} == set(range(8))
  assert png is None or png.stat().st_size > 0


# --- GPU-shaped profiles, built here ---------------------------------------------

def _quote(value) -> str:
  if isinstance(value, bytes):
    return '"' + "".join(f"\\{b:03o}" for b in value) + '"'
  return json.dumps(value)


def _plane(plane_id, name, lines=(), stats=None, event_stats=None):
  """Text proto of an XPlane. lines: {line name: [(event name, start_us,
  duration_us, {stat: value})]}; event_stats: {event metadata name: {stat:
  value}} (metadata only, as in the metadata plane)."""
  names, stat_ids = {}, {}

  def meta(n):
    return names.setdefault(n, len(names) + 1)

  def stat(k, v):
    sid = stat_ids.setdefault(k, len(stat_ids) + 1)
    field = ("bytes_value" if isinstance(v, bytes) else "str_value"
             if isinstance(v, str) else "int64_value")
    return f"stats {{ metadata_id: {sid} {field}: {_quote(v)} }}"

  parts = [f"id: {plane_id}", f"name: {_quote(name)}"]
  for k, (line, events) in enumerate(dict(lines).items()):
    evs = " ".join(
        f"events {{ metadata_id: {meta(n)} offset_ps: {int(s * 1e6)} "
        f"duration_ps: {int(d * 1e6)} "
        + " ".join(stat(a, b) for a, b in st.items()) + " }"
        for n, s, d, st in events)
    parts.append(f"lines {{ id: {k + 1} name: {_quote(line)} timestamp_ns: 0 {evs} }}")
  for k, v in (stats or {}).items():
    parts.append(stat(k, v))
  metadata_stats = {n: " ".join(stat(a, b) for a, b in st.items())
                    for n, st in (event_stats or {}).items()}
  for n in metadata_stats:
    meta(n)
  for n, i in names.items():
    parts.append(f"event_metadata {{ key: {i} value {{ id: {i} name: {_quote(n)} "
                 f"{metadata_stats.get(n, '')} }} }}")
  for k, i in stat_ids.items():
    parts.append(f"stat_metadata {{ key: {i} value {{ id: {i} name: {_quote(k)} }} }}")
  return "planes { " + " ".join(parts) + " }"


def _gpu(devices, metadata=""):
  """A report of GPU planes {device: {stream: [events]}} (times in us)."""
  text = " ".join([metadata] + [_plane(d + 1, f"/device:GPU:{d}", lines)
                                for d, lines in devices.items()])
  data = ProfileData.text_proto_to_serialized_xspace(text)
  return jo.MeasuredReport.from_capture(read_space(data, source="test"))


def _op(name, module="jit_f"):
  return {"hlo_op": name, "hlo_module": module, "program_id": 7}


def _one(report, name, device=0):
  (r,) = [r for r in report.measured if r.name == name and r.device == device]
  return r


def test_two_compute_streams_count_once():
  report = _gpu({0: {
      "Stream #1(Compute)": [("fusion_kernel", 50, 100, _op("fusion.1"))],
      "Stream #2(Compute)": [("gemm", 120, 60, _op("custom-call.2"))],
      "Stream #3(Comm)": [("ncclDevKernel_AllGather_RING_LL", 100, 100,
                           _op("all-gather-start.1"))]}})
  r = _one(report, "all-gather-start.1")
  # Compute is busy over [50, 180): the collective [100, 200) is hidden for 80
  # us, not 40 + 60 + ... summed per stream.
  assert (r.kind, r.runs) == ("all-gather", 1)
  assert (r.measured_s, r.hidden_s) == pytest.approx((100e-6, 80e-6), abs=1e-12)
  assert r.exposed_s == pytest.approx(20e-6, abs=1e-12)
  t = report.totals[0]
  assert (t["comm_s"], t["hidden_s"], t["compute_s"]) == pytest.approx(
      (100e-6, 80e-6, 130e-6), abs=1e-12)
  assert t["overlap_fraction"] == pytest.approx(0.8)
  assert r.flags == []


def test_a_collective_on_the_compute_stream():
  report = _gpu({0: {"Stream #7(Compute)": [
      ("fusion_kernel", 0, 100, _op("fusion.1")),
      ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 50, _op("all-reduce-start.3")),
      ("fusion_kernel", 150, 50, _op("fusion.2"))]}})
  r = _one(report, "all-reduce-start.3")
  assert (r.kind, r.runs, r.hidden_s) == ("all-reduce", 1, 0.0)
  assert r.measured_s == pytest.approx(50e-6, abs=1e-12)
  assert any(f.startswith("on the compute stream (Stream #7(Compute))")
             for f in r.flags), r.flags
  assert "overlapped nothing" in r.flags


def test_one_collective_of_several_kernels_runs_once():
  report = _gpu({0: {
      "Stream #1(Compute)": [("gemm", 0, 300, _op("custom-call.1"))],
      "Stream #2(Comm)": [("nccl_a", 100, 30, _op("all-gather-start.2")),
                          ("nccl_b", 130, 30, _op("all-gather-start.2")),
                          ("nccl_c", 170, 20, _op("all-gather-start.2"))]}})
  r = _one(report, "all-gather-start.2")
  assert r.runs == 1
  assert (r.measured_s, r.hidden_s) == pytest.approx((80e-6, 80e-6), abs=1e-12)


def test_loop_occurrences_each_run():
  compute = [("body_fusion", 100 * i, 50, _op("fusion.9")) for i in range(4)]
  comm = [("ncclDevKernel_SendRecv", 100 * i + 30, 40,
           _op("collective-permute-start.1")) for i in range(4)]
  report = _gpu({0: {"Stream #1(Compute)": compute, "Stream #2(Comm)": comm}})
  r = _one(report, "collective-permute-start.1")
  assert (r.kind, r.runs) == ("collective-permute", 4)
  # Each iteration: [30, 70) beside compute [0, 50): 20 us hidden, 20 exposed.
  assert (r.measured_s, r.hidden_s) == pytest.approx((160e-6, 80e-6), abs=1e-12)


def test_a_collective_with_no_hlo_op_is_named_by_its_kernel():
  report = _gpu({0: {
      "Stream #1(Compute)": [("fusion_kernel", 0, 100, _op("fusion.1"))],
      "Stream #2(Comm)": [
          ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
           50, 100, {})]}})
  r = _one(report, "ncclDevKernel_AllGather_RING_LL")
  assert (r.kind, r.runs, r.module) == ("all-gather", 1, None)
  assert (r.measured_s, r.hidden_s) == pytest.approx((100e-6, 50e-6), abs=1e-12)
  assert r.flags[0].startswith("no hlo_op on its kernel")


def test_waiting_for_peers_is_the_time_before_the_last_device_started():
  kernel = lambda s: [("nccl", s, 200 - s, _op("all-reduce-start.1"))]  # noqa: E731
  report = _gpu({0: {"Stream #2(Comm)": kernel(100)},
                 1: {"Stream #2(Comm)": kernel(160)}})
  assert _one(report, "all-reduce-start.1", 0).waiting_s == pytest.approx(60e-6)
  assert _one(report, "all-reduce-start.1", 1).waiting_s == 0.0
  assert any("includes 60 us waiting for peers" in f
             for f in _one(report, "all-reduce-start.1", 0).flags)


@pytest.fixture(scope="module")
def hlo_proto():
  """(HloProto bytes, its two collectives' names and kinds) of a live CPU
  compile with an all-reduce and an all-gather."""
  def body(x):
    return jax.lax.psum(x, "x"), jax.lax.all_gather(x, "x", tiled=True)
  f = jax.jit(jax.shard_map(body, mesh=_mesh(2), in_specs=P("x"),
                            out_specs=(P("x"), P("x"))))
  compiled = f.lower(jnp.ones((4, 4))).compile()
  module = compiled.runtime_executable().hlo_modules()[0]
  proto = module.as_serialized_hlo_module_proto()
  names = dict(COLLECTIVE.findall(compiled.as_text()))
  return bytes([0x0A]) + _varint(len(proto)) + proto, names, module.name


def _varint(n):
  out = bytearray()
  while True:
    out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
    n >>= 7
    if not n:
      return bytes(out)


def _metadata(proto, module, jaxlib):
  return _plane(100, "/host:metadata", stats={"jaxlib_version": jaxlib},
                event_stats={f"{module}(7)": {"Hlo Proto": proto}})


def test_an_embedded_hlo_proto_gives_kinds_and_the_modelled_records(hlo_proto):
  proto, names, module = hlo_proto
  (reduce_name,) = [n for n, k in names.items() if k == "all-reduce"]
  (gather_name,) = [n for n, k in names.items() if k == "all-gather"]
  report = _gpu({0: {"Stream #2(Comm)": [
      ("some_kernel", 0, 10, _op(reduce_name, module))]}},
      metadata=_metadata(proto, module, running_jaxlib()))
  assert set(report.modelled) == {module}
  ran = _one(report, reduce_name)
  assert (ran.kind, ran.runs) == ("all-reduce", 1)
  assert ran.modelled["kind"] == "all-reduce"
  missing = _one(report, gather_name)
  assert (missing.kind, missing.runs, missing.measured_s) == ("all-gather", 0, 0.0)
  assert missing.flags[0].startswith("no kernel found")
  assert "--xla_gpu_enable_command_buffer=" in missing.flags[0]


def test_an_hlo_proto_of_another_jaxlib_is_not_converted(hlo_proto):
  proto, names, module = hlo_proto
  (reduce_name,) = [n for n, k in names.items() if k == "all-reduce"]
  report = _gpu({0: {"Stream #2(Comm)": [
      ("nccl_all_reduce", 0, 10, _op(reduce_name, module))]}},
      metadata=_metadata(proto, module, "0.0.1"))
  assert report.modelled == {}
  assert any("written by jaxlib 0.0.1" in n for n in report.notes)
  assert _one(report, reduce_name).kind == "all-reduce"   # by its name


def test_a_public_mi300_capture_parses():
  report = jo.MeasuredReport.from_profile(FIXTURES / "mi300_conv_tw003.xplane.pb")
  assert report.backend == "gpu"
  assert report.measured == []
  assert sorted(report.totals) == list(range(8))
  assert all(t["compute_s"] > 0 and t["comm_s"] == 0 and
             t["overlap_fraction"] is None for t in report.totals.values())
  assert "no collectives ran in this profile" in report.notes


# --- pieces and bad input ---------------------------------------------------------

def test_wire_reader_and_intervals():
  data = bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x68, 0x69, 0x19]) + bytes(8)
  assert [(f, v) for f, _, v in wire.fields(data)] == [
      (1, 150), (2, b"hi"), (3, bytes(8))]
  with pytest.raises(ValueError):
    list(wire.fields(bytes([0x12, 0x05, 0x68])))
  u = intervals.union([(5, 6), (0, 2), (1, 3), (3, 4)])
  assert u == [(0, 4), (5, 6)]
  assert intervals.intersect(u, [(3.5, 5.5)]) == [(3.5, 4), (5, 5.5)]


@pytest.mark.parametrize("name, kind", [
    ("all-gather-start.1", "all-gather"), ("all-gather-done.1", None),
    ("psum_invariant.7", "all-reduce"), ("psum_scatter.2", "reduce-scatter"),
    ("ppermute.3", "collective-permute"), ("all_to_all.1", "all-to-all"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "reduce-scatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "collective-permute"),
    ("triton_all_reduce_one_shot", "all-reduce"), ("loop_add_fusion", None),
    ("while.2", None)])
def test_kinds_from_names(name, kind):
  assert classify.kind_from_name(name) == kind


@pytest.mark.parametrize("case", ["missing", "empty", "malformed", "no-profile-dir",
                                  "hardware"])
def test_cli_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
  path = tmp_path / "x.xplane.pb"
  args = []
  if case == "empty":
    path.write_bytes(b"")
  elif case == "malformed":
    path.write_bytes(b"\x12\x05not a profile")
  elif case == "no-profile-dir":
    path = tmp_path
  elif case == "hardware":
    path = FIXTURES / "mi300_conv_tw003.xplane.pb"
    args = ["--hardware", "tpu-v99"]
  assert main(["profile", str(path), *args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("jax-overlap profile: error: "), err
