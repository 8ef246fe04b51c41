"""`jax-overlap inspect`: exit codes, JSON, pictures and --diff."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_overlap._src.cli.main import main

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
PREFETCH = str(FIXTURES / "gpu_prefetch.txt")
NO_LHS = str(FIXTURES / "gpu_prefetch_no_lhs.txt")
SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

COLLECTIVE_FIELDS = [
    "kind", "start", "done", "computation", "where", "leaf", "step", "thread", "link",
    "queued_behind", "async",
    "made_blocking", "bytes", "bytes_in_flight", "group_size", "overlapped",
    "spans_iteration",
    "trip_count", "loop", "runs", "comm_s", "exposed_s", "flags", "cost_source"]


def run(capsys, *argv):
  code = main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_table_on_a_gpu_dump(capsys):
  # The default is the summary now; --full is the table it was.
  code, out, err = run(capsys, "inspect", PREFETCH, "--full")
  assert code == 0 and err == ""
  assert "all-gather" in out and "all-reduce" in out
  assert "modelled on h100, not measured" in out
  assert "overlaps nothing" in out
  assert "train.py:29, leaf unknown" in out


def test_json_has_the_documented_fields(capsys):
  code, out, _ = run(capsys, "inspect", str(FIXTURES / "tpu_loop.txt"),
                     "--json", "--hardware", "tpu-v5p")
  assert code == 0
  data = json.loads(out)
  assert list(data["totals"]) == ["comm_s", "exposed_s", "bound_exposed_s",
                                  "serial_link_bound_s"]
  assert data["schedule"] == "compiled"
  assert data["hardware"]["name"] == "tpu-v5p"
  assert "not measured" in data["modelled"]
  for c in data["collectives"]:
    assert list(c) == COLLECTIVE_FIELDS
    assert not c["start"].startswith("%") and not c["done"].startswith("%")
    assert all(not n.startswith("%") for n in c["overlapped"])
  assert data["collectives"][0]["spans_iteration"] is True
  assert data["copies"] == [] and data["written"] == []


def test_copies_in_json(capsys):
  code, out, _ = run(capsys, "inspect", str(FIXTURES /
                                           "threads_and_copies.txt"), "--json")
  (copy,) = json.loads(out)["copies"]
  assert list(copy) == ["start", "done", "computation", "thread", "bytes",
                        "overlapped", "spans_iteration", "trip_count", "loop",
                        "runs", "copy_s", "exposed_s", "flags"]
  assert (copy["start"], copy["done"]) == ("copy-start", "copy-done")


def test_timeline_png_and_trace(capsys, tmp_path):
  png, trace = tmp_path / "t.png", tmp_path / "t.json"
  code, out, err = run(capsys, "inspect", PREFETCH, "--timeline", str(png),
                       "--trace", str(trace))
  assert code == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"wrote {png}" in err and f"wrote {trace}" in err
  data = json.loads(trace.read_text())
  check_trace_event_format(data)
  names = {e["args"]["name"] for e in data["traceEvents"]
           if e.get("name") == "thread_name"}
  assert {"compute", "all-gather all-gather-start",
          "all-reduce all-reduce-start"} <= names
  categories = {e["cat"] for e in data["traceEvents"] if e["ph"] == "X"}
  assert {"compute", "in flight", "transfer", "exposed", "wait"} <= categories


def check_trace_event_format(data):
  """The parts of the Trace Event Format that Perfetto's importer needs."""
  assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
  named = set()
  for e in data["traceEvents"]:
    assert e["ph"] in ("X", "M")
    assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    assert isinstance(e["name"], str)
    if e["ph"] == "M":
      assert e["name"] in ("process_name", "thread_name", "thread_sort_index")
      assert isinstance(e["args"], dict)
      if e["name"] == "thread_name":
        named.add(e["tid"])
    else:
      assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
      assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
      assert e["tid"] in named
  json.dumps(data, allow_nan=False)


def test_diff_shows_what_a_flag_changed(capsys):
  code, out, _ = run(capsys, "inspect", "--diff", NO_LHS, PREFETCH)
  assert code == 0
  assert "changed  all-gather all-gather-start" in out
  assert ("overlapped: 0 -> 3 ops (+convert_fusion, +cublas-gemm.1, "
          "+tanh_fusion)") in out
  assert "1 collective(s) unchanged." in out
  code, out, _ = run(capsys, "inspect", "--diff", NO_LHS, PREFETCH, "--json")
  data = json.loads(out)
  (change,) = data["changed"]
  assert change["kind"] == "all-gather"
  assert change["overlapped"][0] == []
  assert change["exposed_s"][0] > change["exposed_s"][1] == 0
  assert data["unchanged"] == 1 and data["only_in_a"] == []


def test_diff_of_a_dump_with_itself(capsys):
  code, out, _ = run(capsys, "inspect", "--diff", PREFETCH, PREFETCH)
  assert code == 0 and "changed  " not in out
  assert "2 collective(s) unchanged." in out


@pytest.mark.parametrize("argv, message", [
    (["inspect", str(FIXTURES / "missing.txt")], "cannot read this file"),
    (["inspect", str(FIXTURES / "malformed_unclosed.txt")],
     "malformed_unclosed.txt:5: a bracket opened"),
    (["inspect", str(FIXTURES / "truncated.txt")], "(truncated?)"),
    (["inspect", PREFETCH, "--hardware", "tpu-v9"], "unknown hardware"),
    (["inspect", PREFETCH, "--hardware", "/no/such/profile.toml"],
     "cannot read hardware profile"),
    (["inspect"], "give a FILE to inspect, or --diff A B"),
    (["inspect", PREFETCH, "--diff", PREFETCH, NO_LHS], "not both"),
    (["inspect", "--diff", PREFETCH, str(FIXTURES / "not_hlo.txt")],
     "not_hlo.txt:1:"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
  code, out, err = run(capsys, *argv)
  assert code == 2 and out == ""
  assert err.count("\n") == 1 and message in err
  assert err.startswith("jax-overlap inspect: error: ")


REAL = FIXTURES / "real"
TPU_DUMP = str(REAL / "tpu_dp_tp_mlp-jax0.12.0.1.after_optimizations.txt")
GPU_DUMP = str(REAL / "gpu_dp_tp_mlp-jax0.12.0.1.after_optimizations.txt")
CPU_DUMP = str(REAL / "cpu-jax0.12.0.1-jaxlib0.12.0.1.dump.txt")


@pytest.mark.parametrize("path, profile, why", [
    (TPU_DUMP, "tpu-v5e", "the default for a TPU dump"),
    (str(FIXTURES / "tpu_loop.txt"), "tpu-v5e", "the default for a TPU dump"),
    (GPU_DUMP, "h100", "the default for a GPU dump"),
    (CPU_DUMP, "h100", "the default; the dump does not say its platform"),
], ids=["tpu", "tpu-hand-written", "gpu", "cpu"])
def test_default_profile_follows_the_dumps_platform(capsys, path, profile, why):
  code, out, _ = run(capsys, "inspect", path)
  assert code == 0
  assert f"times modelled on {profile}, not measured" in out.splitlines()[1]
  assert f"No hardware was named: modelled on {profile}, {why}" in out
  code, out, _ = run(capsys, "inspect", path, "--json")
  assert json.loads(out)["hardware"]["name"] == profile


def test_a_named_profile_wins_over_the_dumps_platform(capsys):
  code, out, _ = run(capsys, "inspect", TPU_DUMP, "--hardware", "h100")
  assert code == 0 and "times modelled on h100" in out
  assert "No hardware was named" not in out
  # A diff models both dumps on one profile: by default, A's.
  code, out, _ = run(capsys, "inspect", "--diff", TPU_DUMP, GPU_DUMP)
  assert code == 0 and "(times modelled on tpu-v5e, not measured)" in out


def test_argparse_errors_exit_2(capsys):
  with pytest.raises(SystemExit) as info:
    main(["nosuchcommand"])
  assert info.value.code == 2
  with pytest.raises(SystemExit) as info:
    main(["inspect", PREFETCH, "--nosuchflag"])
  assert info.value.code == 2


@pytest.mark.subprocess
def test_python_dash_m(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(SRC), "JAX_PLATFORMS": "cpu"}
  ok = subprocess.run([sys.executable, "-m", "jax_overlap", "inspect",
                       PREFETCH, "--json"], capture_output=True, text=True,
                      env=env, timeout=300)
  assert ok.returncode == 0, ok.stderr
  assert json.loads(ok.stdout)["collectives"][0]["kind"] == "all-gather"
  tpu = subprocess.run([sys.executable, "-m", "jax_overlap", "inspect",
                        TPU_DUMP], capture_output=True, text=True, env=env,
                       timeout=300)
  assert tpu.returncode == 0, tpu.stderr
  assert "times modelled on tpu-v5e, not measured" in tpu.stdout
  bad = subprocess.run([sys.executable, "-m", "jax_overlap", "inspect",
                        str(tmp_path / "nothing.txt")], capture_output=True,
                       text=True, env=env, timeout=300)
  assert bad.returncode == 2 and bad.stdout == ""
  assert bad.stderr.strip().count("\n") == 0
