"""`jax-overlap demo` in a reduced size: it trains, checks, reports and writes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

# `make demo` runs the demo on the newest supported jax, and so do these tests:
# two demo runs cost about 100 s a version, more than CI's budget leaves for the
# older two.
pytestmark = pytest.mark.skipif(
    jax.__version__.startswith(("0.10.", "0.11.")),
    reason="the demo's tests run on jax 0.12.0.1 only, the jax make demo uses "
    "(CI's time budget)")

DEMO = [sys.executable, "-m", "jax_overlap", "demo"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="120")


@pytest.fixture(scope="module", autouse=True)
def _one_compilation_cache(tmp_path_factory):
  """The module's demo runs share a jax compilation cache: the default demo's
  programs, compiled by test_demo_writes_everything's run, load in
  test_ctrl_c_stops_after_the_step_and_still_writes's instead of compiling
  again (21 -> 8 CPU-s for the second run). What each test checks does not
  depend on compiling; run alone, a test compiles as before."""
  ENV["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
  ENV["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  yield
  del ENV["JAX_COMPILATION_CACHE_DIR"], ENV["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]


def _run(args, **kwargs):
  return subprocess.run(DEMO + args, capture_output=True, text=True,
                        timeout=600, env=ENV, **kwargs)


def test_demo_writes_everything(tmp_path):
  out = tmp_path / "demo"
  res = _run(["--steps", "12", "--out", str(out), "--report-width", "128"])
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  text = res.stdout
  assert "the same" in text                      # the check against a plain scan
  assert "modelled, not measured" in text
  assert "On CPU the runtime blocks on collectives" in text    # the measured line
  for name in ("timeline.png", "trace.json", "report.json", "loss.png"):
    path = out / name
    assert path.exists() and path.stat().st_size > 0, name
    assert str(path) in text                     # and says where
  report = json.loads((out / "report.json").read_text())
  assert report["schedule"] == "written"
  assert {"collectives", "copies", "totals", "written"} <= set(report)
  assert set(report["totals"]) == {"comm_s", "exposed_s", "bound_exposed_s",
                                   "serial_link_bound_s"}
  # The demo prints the summary (totals, most exposed, hints), not the table
  # of every collective (it printed about 500 lines).
  assert "What to change:" in text and "Most exposed (" in text
  assert len(text.splitlines()) < 90, len(text.splitlines())
  kinds = {c["kind"] for c in report["collectives"]}
  assert {"all-gather", "reduce-scatter"} <= kinds, kinds
  demo = report["demo"]
  assert demo["steps_run"] == 12 and len(demo["losses"]) == 12
  assert demo["check"]["loss_abs_diff"] < 1e-4
  assert demo["losses"][-1] < demo["losses"][0]
  trace = json.loads((out / "trace.json").read_text())
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  assert events and all("ph" in e for e in events)
  # The overlapped step hides communication the plain scan leaves exposed.
  assert report["totals"]["exposed_s"] < demo["plain_scan_totals"]["exposed_s"]


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--devices", "3"], "--devices must divide 64"),
    (["--report-width", "100"], "--report-width must be 0 or a multiple of 64"),
])
def test_demo_bad_arguments(args, message):
  res = _run(args)
  assert res.returncode == 2 and message in res.stderr, res.stderr


def test_ctrl_c_stops_after_the_step_and_still_writes(tmp_path):
  out = tmp_path / "demo"
  proc = subprocess.Popen(DEMO + ["--steps", "2000", "--out", str(out),
                                  "--report-width", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=ENV)
  seen = []
  try:
    for line in proc.stdout:
      seen.append(line)
      if line.startswith("2. Training"):
        break
    # The handler is in place a few lines after "2. Training" is printed;
    # 3 s later the first step is still compiling (or running): it finishes,
    # and the loop stops after it. (15 s here trained about 40 steps more,
    # the test's largest cost, for the same check: 0 < steps_run < 2000.)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, "".join(seen) + rest
  assert "stopped by Ctrl-C" in rest
  report = json.loads((out / "report.json").read_text())
  assert report["demo"]["interrupted"] and 0 < report["demo"]["steps_run"] < 2000
  assert (out / "loss.png").exists() and (out / "timeline.png").exists()


@pytest.mark.slow
def test_pipeline_demo_trains_checks_and_draws_the_stages(tmp_path):
  out = tmp_path / "demo"
  res = subprocess.run(DEMO + ["--pipeline", "1f1b", "--microbatches", "4",
                               "--steps", "2", "--out", str(out),
                               "--report-width", "0"],
                       capture_output=True, text=True, timeout=1500, env=ENV)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  text = res.stdout
  assert "4 pipeline stages x 2 FSDP devices" in text and "the same" in text
  assert "ticks send (each send's leaf names its tick" in text
  report = json.loads((out / "report.json").read_text())
  assert any((c["leaf"] or "").startswith("pipeline tick")   # the report names the ticks
             for c in report["collectives"])
  demo = report["demo"]
  assert demo["pipeline"] == "1f1b" and demo["steps_run"] == 2
  assert demo["check"]["grad_max_rel_diff"] < 1e-4
  trace = json.loads((out / "trace.json").read_text())["traceEvents"]
  rows = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
  assert {f"stage {d}" for d in range(4)} <= rows
  assert any(e.get("name", "").endswith("idle (bubble)") for e in trace)


def test_pipeline_demo_bad_arguments():
  res = _run(["--pipeline", "1f1b", "--devices", "4"])
  assert res.returncode == 2 and "--pipeline runs on 8 devices" in res.stderr
  res = _run(["--pipeline", "1f1b", "--microbatches", "2"])
  assert res.returncode == 2 and "--microbatches must be >= 4" in res.stderr
  res = _run(["--pipeline", "dualpipev", "--microbatches", "4"])
  assert res.returncode == 2 and "needs --microbatches >= 8" in res.stderr


@pytest.mark.slow
def test_mesh_demo_trains_the_4d_example():
  res = _run(["--mesh", "pp=2,fsdp=2,tp=2", "--steps", "3"])
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  text = res.stdout
  assert "8 virtual CPU devices as pp=2 x fsdp=2 x tp=2" in text
  assert "all_gather_matmul / matmul_reduce_scatter rings" in text
  assert "the same" in text               # the check against the single program
  losses = [float(v) for v in re.findall(r"step +\d+  loss ([0-9.]+)", text)]
  assert len(losses) == 3 and all(np.isfinite(losses)), text


@pytest.mark.parametrize("args, message", [
    (["--mesh", "pp=2,fsdp"], "write axis=size pairs"),
    (["--mesh", "pp=2,tp=2,cp=2"], "one of 'tp' / 'cp' / 'ep'"),
    (["--mesh", "pp=2,fsdp=2", "--pipeline", "1f1b"], "--mesh and --pipeline"),
])
def test_mesh_demo_bad_arguments(args, message):
  res = _run(args)
  assert res.returncode == 2 and message in res.stderr, res.stderr
