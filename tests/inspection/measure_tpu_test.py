"""The profile reader on real TPU captures, taken on one v5e chip.

tests/fixtures/profiles/tpu_v5e/ holds `jax.profiler.trace` captures of
benchmarks/chip_captures.py's programs (jax 0.10.2, libtpu 0.0.42.1, 2 steps
each) and the compiled module each ran; its README says what each trace
shows. On one chip a collective-permute stays an async pair, so a future's
window is real: what ran inside it was read off the trace by hand, and the
reader must say the same.
"""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

import jax_overlap as jo
from jax_overlap._src.cli.main import main
from jax_overlap._src.inspection.measured import intervals as iv
from jax_overlap._src.inspection.measured import tpu_lines
from jax_overlap._src.inspection.measured.classify import OpKinds
from jax_overlap._src.inspection.measured.hlo_proto import running_jaxlib
from jax_overlap._src.inspection.measured.xplane import read_capture
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text

TPU = pathlib.Path(__file__).parents[1] / "fixtures" / "profiles" / "tpu_v5e"
US = 1e-6


def _hlo(name: str) -> str:
  return gzip.decompress((TPU / f"{name}.hlo.txt.gz").read_bytes()).decode()


def _report(name: str, with_hlo: bool = True):
  return jo.MeasuredReport.from_profile(
      TPU / f"{name}.xplane.pb.gz", hardware="tpu-v5e",
      hlo=_hlo(name) if with_hlo else None)


def _permute(report):
  (r,) = report.measured
  return r


def _inside(report, occurrence) -> float:
  """Seconds of compute inside one occurrence's window."""
  (t,) = report.timelines
  return iv.length(iv.intersect(iv.union(occurrence.spans), t.compute))


ALL = ["futures", "scan_ordered", "scan_unordered", "scan_dependent",
       "fsdp_scan_step"]


@pytest.mark.parametrize("name", ALL)
def test_events_are_named_by_instruction_and_module(name):
  capture = read_capture(TPU / f"{name}.xplane.pb.gz")
  assert capture.backend == "tpu"
  assert capture.events
  module = {"futures": "jit_futures", "fsdp_scan_step": "jit_train_step"}.get(
      name, "jit_scan_of_permutes")
  assert {e.module for e in capture.events} == {module}
  assert {e.run_id for e in capture.events} and None not in {
      e.run_id for e in capture.events}
  for e in capture.events:
    assert " " not in e.hlo_op and "=" not in e.hlo_op, e.hlo_op[:80]
  # ... the names `inspect` gives the same module's instructions.
  module_names = {i.name for _, i in parse_hlo_text(_hlo(name)).instructions()}
  assert {e.hlo_op for e in capture.events} <= module_names


def test_an_async_pair_is_one_collective_with_the_matmul_inside():
  # scan_ordered: under program_order each of the 4 steps a run (2 runs)
  # starts the permute, runs the matmul fusion (89.9 us) and tanh (3.6 us),
  # then waits on the done: a 96.25 us window, 93.5 us of it compute.
  report = _report("scan_ordered")
  r = _permute(report)
  assert (r.name, r.kind, r.module, r.runs) == (
      "collective-permute-start", "collective-permute", "jit_scan_of_permutes", 8)
  assert r.measured_s == pytest.approx(8 * 96.25 * US, rel=0.01)
  assert r.hidden_s == pytest.approx(8 * 93.48 * US, rel=0.01)
  assert r.exposed_s == pytest.approx(8 * 2.77 * US, rel=0.05)
  (t,) = report.timelines
  assert len(t.occurrences) == 8
  for occ in t.occurrences:
    assert occ.line == tpu_lines.ASYNC_LINE
    assert _inside(report, occ) > 85 * US
  assert not any(f.startswith("on the compute stream") for f in r.flags)
  assert r.flags == []


def test_the_done_and_the_start_are_not_rows_of_their_own():
  for name in ("futures", "scan_ordered", "scan_unordered", "scan_dependent"):
    report = _report(name)
    assert [r.name for r in report.measured] == ["collective-permute-start"]


def test_a_loop_is_not_compute():
  # The `%while` event spans its body (398.6 us a run), start and done
  # events included: counted as compute, every window would read 100% hidden
  # (as the reader said before). Its body's ops are the compute.
  report = _report("scan_ordered")
  r = _permute(report)
  assert r.hidden_s < r.measured_s
  (t,) = report.timelines
  while_spans = [e for e in read_capture(TPU / "scan_ordered.xplane.pb.gz").events
                 if e.opcode == "while"]
  assert len(while_spans) == 2
  in_loops = iv.length(iv.intersect(iv.union((e.start, e.end) for e in while_spans),
                                    t.compute))
  body = sum(e.end - e.start for e in while_spans)
  assert in_loops < 0.98 * body
  assert not OpKinds(None).is_compute("while.9", "while")
  assert not OpKinds(None).is_compute("loop_body", "while")
  assert OpKinds(None).is_compute("fusion.8", "fusion")


def test_a_window_with_the_matmul_after_it_is_reported_exposed():
  # scan_dependent: the matmul reads the permuted value, so the done comes
  # first. Each 4.78 us window holds the start (2.73 us, on the core) and an
  # unrelated 2.02 us copy; the 90.3 us matmul fusion runs after it. The
  # reader before said 100% hidden (the `%while` event counted as compute).
  report = _report("scan_dependent")
  r = _permute(report)
  assert r.runs == 8
  assert r.measured_s == pytest.approx(8 * 4.78 * US, rel=0.01)
  assert r.hidden_s == pytest.approx(8 * 2.02 * US, rel=0.02)
  assert r.exposed_s == pytest.approx(8 * 2.76 * US, rel=0.03)
  (t,) = report.timelines
  for occ in t.occurrences:
    assert _inside(report, occ) < 2.1 * US
  # The matmul is compute, outside every window.
  capture = read_capture(TPU / "scan_dependent.xplane.pb.gz")
  matmuls = [e for e in capture.events
             if e.hlo_op == "convolution_tanh_fusion.2"]
  assert len(matmuls) == 8
  windows = iv.union(s for occ in t.occurrences for s in occ.spans)
  assert iv.length(iv.intersect(windows, iv.union(
      (e.start, e.end) for e in matmuls))) == 0
  assert iv.length(iv.intersect(t.compute, iv.union(
      (e.start, e.end) for e in matmuls))) == pytest.approx(8 * 90.33 * US, rel=0.01)


def test_xla_overlapped_the_unordered_scan_by_itself():
  # Without program_order, XLA's TPU scheduler still put the matmul (here a
  # convolution_tanh fusion, 90 us) inside the 94.7 us window.
  r = _permute(_report("scan_unordered"))
  assert r.runs == 8
  assert r.measured_s == pytest.approx(8 * 94.74 * US, rel=0.01)
  assert r.hidden_s / r.measured_s > 0.95


def test_a_future_with_a_matmul_between():
  # futures: the start itself keeps the core 22.5 us, then the matmul (89.8
  # us) and tanh (13.1 us) run inside the 125.5 us window.
  report = _report("futures")
  r = _permute(report)
  assert (r.runs, r.module) == (2, "jit_futures")
  assert r.measured_s == pytest.approx(2 * 125.5 * US, rel=0.01)
  assert r.hidden_s == pytest.approx(2 * 103 * US, rel=0.02)
  assert r.exposed_s == pytest.approx(2 * 22.6 * US, rel=0.05)


def test_the_module_given_gives_kinds_sources_and_modelled_records():
  report = _report("scan_ordered")
  r = _permute(report)
  assert set(report.modelled) == {"jit_scan_of_permutes"}
  assert r.modelled is not None and r.modelled["kind"] == "collective-permute"
  assert r.where and "chip_captures.py" in r.where
  text = str(report)
  assert "modelled on tpu-v5e" in text and "collective-permute-start " in text


def test_without_the_module_the_embedded_proto_is_read_by_its_own_jaxlib():
  report = _report("scan_ordered", with_hlo=False)
  r = _permute(report)
  assert (r.name, r.kind, r.runs) == ("collective-permute-start",
                                      "collective-permute", 8)
  if running_jaxlib() == "0.10.2":          # the jaxlib that wrote the capture
    assert set(report.modelled) == {"jit_scan_of_permutes"}
  else:
    assert not report.modelled
    assert any("written by jaxlib 0.10.2" in n for n in report.notes)


def test_an_fsdp_scan_step_on_one_chip_has_compute_and_no_collectives():
  # On one device XLA removes fsdp_scan's gathers and reduce-scatters (and at
  # 2 layers its loops): the step is compute, async copies and slices that
  # are not collectives, and the waits on them, which are not compute.
  report = _report("fsdp_scan_step")
  assert report.measured == []
  assert "no collectives ran in this profile" in report.notes
  assert set(report.modelled) == {"jit_train_step"}
  capture = read_capture(TPU / "fsdp_scan_step.xplane.pb.gz")
  ops = [e for e in capture.events if e.line == tpu_lines.OPS_LINE]
  waits = iv.union((e.start, e.end) for e in ops if e.opcode.endswith("-done"))
  (t,) = report.totals.values()
  (timeline,) = report.timelines
  assert 0 < t["compute_s"] <= iv.length(iv.union((e.start, e.end) for e in ops))
  assert iv.length(iv.intersect(waits, timeline.compute)) < 0.01 * iv.length(waits)


def test_hlo_of_another_module_is_said():
  report = jo.MeasuredReport.from_profile(
      TPU / "futures.xplane.pb.gz", hardware="tpu-v5e", hlo=_hlo("scan_ordered"))
  assert any("module jit_scan_of_permutes, which did not run" in n
             for n in report.notes)


def test_cli_reads_a_tpu_capture_with_its_module(tmp_path, capsys):
  hlo = tmp_path / "scan_ordered.hlo.txt"
  hlo.write_text(_hlo("scan_ordered"))
  assert main(["profile", str(TPU / "scan_ordered.xplane.pb.gz"), "--hardware",
               "tpu-v5e", "--hlo", str(hlo), "--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  (r,) = data["measured"]
  assert (r["name"], r["runs"], r["modelled"]["kind"]) == (
      "collective-permute-start", 8, "collective-permute")
  assert main(["profile", str(TPU / "scan_ordered.xplane.pb.gz"), "--hlo",
               str(tmp_path / "missing.txt")]) == 2
  assert "cannot read this file" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    ("%fusion.8 = bf16[2048,2048]{1,0:T(8,128)(2,1)S(1)} fusion(bf16[2048,2048] "
     "%a), kind=kOutput, calls=%f", ("fusion.8", "fusion")),
    ("%while = (s32[]{:T(128)}, f32[8]{0:T(8)}) while((s32[], f32[8]) %t), "
     "condition=%c, body=%b", ("while", "while")),
    ("%collective-permute-done = f32[4]{0} collective-permute-done((f32[4], "
     "f32[4], u32[], u32[]) %collective-permute-start)",
     ("collective-permute-done", "collective-permute-done")),
    ("%slice-start = ((f32[8]{0}), f32[4]{0}, s32[]) async-start(f32[8]{0} %x), "
     "calls=%s", ("slice-start", "async-start")),
    ("fusion.3", None),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", None),
])
def test_instruction_text(text, expected):
  assert tpu_lines.instruction(text) == expected


def test_module_names():
  assert tpu_lines.module_name("jit_scan_of_permutes(14577921080989732090)") == \
      "jit_scan_of_permutes"
  assert tpu_lines.module_name("jit_f") == "jit_f"
