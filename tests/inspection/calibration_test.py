"""The cost model against the chip: every program benchmarks/calibrate.py
measured on a TPU v5e (benchmarks/results/chip-2026-12-06/calibration: the
device's own times and the compiled modules, saved) is modelled within
+-15% by `OverlapReport.from_hlo(text, hardware="tpu-v5e")`. A change to the
model that moves any of them out fails here (issue 44's goal; the table is
docs/overlap-report.md "Checked on a TPU v5e")."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ROOT / "benchmarks" / "results" / "chip-2026-12-06" / "calibration"


def _calibrate():
  spec = importlib.util.spec_from_file_location(
      "calibrate", ROOT / "benchmarks" / "calibrate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_measured_program_is_modelled_within_15_percent():
  calibrate = _calibrate()
  env, rows = calibrate.report_rows(RUNS, "tpu-v5e")
  assert env["device_kind"] == "TPU v5 lite" and len(rows) == 31
  off = [(r["program"], r.get("ratio"), r.get("error")) for r in rows
         if "ratio" not in r or abs(r["ratio"] - 1) > calibrate.TOLERANCE]
  assert not off, off

