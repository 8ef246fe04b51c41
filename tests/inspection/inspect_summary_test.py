"""The short report (`print(report)`, `jax-overlap inspect FILE`): totals, the
collectives that expose the most, hints; and output that survives a pipe."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from jax_overlap import OverlapReport
from jax_overlap._src.cli.main import main
from jax_overlap._src.inspection.report.diff import diff_reports

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
REAL = FIXTURES / "real"
GPU_STEP = REAL / "gpu_fsdp_scan_value_and_grad-jax0.12.0.1.after_optimizations.txt"


def run(capsys, *argv):
  code = main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_default_output_is_the_summary(capsys):
  code, out, err = run(capsys, "inspect", str(GPU_STEP), "--hardware", "h100")
  assert code == 0 and err == ""
  assert "collectives in the compiled schedule" in out
  assert re.search(r"Most exposed \(5 of \d+ collectives", out)
  assert "What to change:" in out
  assert not any(_is_header(line) for line in out.splitlines())  # no table
  assert len(out.splitlines()) < 40
  code, full, _ = run(capsys, "inspect", str(GPU_STEP), "--full")
  assert any(_is_header(line) for line in full.splitlines())
  assert len(full.splitlines()) > 24


def _is_header(line):
  return line.startswith("#") and line.split()[1:2] == ["kind"]


def test_every_listed_collective_names_source_and_leaf_or_unknown():
  for path in (FIXTURES / "gpu_prefetch.txt", GPU_STEP):
    text = str(OverlapReport.from_hlo(path))
    rows = [line for line in text.splitlines() if line.startswith("     ")]
    assert rows
    for row in rows:
      assert ("at " in row or "source line unknown" in row), row
      assert ("leaf " in row), row
  text = str(OverlapReport.from_hlo(FIXTURES / "gpu_prefetch_no_lhs.txt"))
  assert "at train.py:29; leaf unknown" in text


def test_hints():
  small = str(OverlapReport.from_hlo(GPU_STEP))
  assert re.search(r"\d+ collectives under 64 KiB expose", small)
  assert "combine these leaves" in small
  assert "made synchronous by the backend" in small
  blocking = str(OverlapReport.from_hlo(FIXTURES / "sync_collectives.txt"))
  assert "use jax_overlap.all_gather_start" in blocking or \
      "use jax_overlap.psum_start" in blocking
  first = str(OverlapReport.from_hlo(FIXTURES / "gpu_prefetch_no_lhs.txt"))
  assert ("the first all-gather of main.42_spmd (all-gather-start at "
          "train.py:29) overlaps nothing") in first
  queued = str(OverlapReport.from_hlo(FIXTURES / "tpu_loop.txt"))
  assert "queued behind all-gather-start.0 on the collectives link" in queued


def test_flags_are_never_cut_in_a_pipe(capsys, tmp_path):
  # A loop whose trip count cannot be read (no known_trip_count, and a
  # condition against no constant); its flag is long.
  text = (FIXTURES / "tpu_loop.txt").read_text().replace(
      'backend_config="{\\"known_trip_count\\":{\\"n\\":\\"4\\"},'
      '\\"known_init_step\\":{\\"init\\":\\"0\\",\\"step\\":\\"1\\"}}"', "").replace(
      "compare(%get-tuple-element.20, %constant.2)",
      "compare(%get-tuple-element.20, %get-tuple-element.20)")
  assert "known_trip_count" not in text
  path = tmp_path / "unknown_trip.txt"
  path.write_text(text)
  for extra in ([], ["--full"]):
    code, out, _ = run(capsys, "inspect", str(path), *extra)
    assert code == 0
    assert "trip count unknown (modelled as 1)" in out, out
    for line in out.splitlines():   # whole wherever it appears
      assert ("trip count unknown" not in line
              or "trip count unknown (modelled as 1)" in line), line


def test_diff_rounds_to_what_the_model_can_tell():
  a = OverlapReport.from_hlo(FIXTURES / "tpu_loop.txt", hardware="h100")
  b = OverlapReport.from_hlo(FIXTURES / "tpu_loop.txt", hardware="h100")
  # Float noise, as two compiles of one program give after sums in another
  # order: no collective changed, and no total either.
  noise = 1 + 3e-12
  b.collectives = [dataclasses.replace(c, exposed_s=c.exposed_s * noise)
                   for c in b.collectives]
  b.totals = {k: v * noise for k, v in b.totals.items()}
  diff = diff_reports(a, b)
  text = str(diff)
  assert diff.changed == [] and diff.unchanged == 4
  assert "e-" not in text
  assert text.count("(no change)") == 4
  # A change the model can tell is listed, rounded.
  b.collectives[3] = dataclasses.replace(b.collectives[3],
                                         exposed_s=a.collectives[3].exposed_s
                                         / 2)
  text = str(diff_reports(a, b))
  assert "changed  all-reduce all-reduce-start.1" in text
  assert "exposed: 40 us -> 20 us (-20 us)" in text
  assert "3 collective(s) unchanged." in text


@pytest.mark.parametrize("path", [FIXTURES / "threads_and_copies.txt",
                                  REAL / "tpu_fsdp_scan_forward-jax0.12.0.1.as_text.txt"],
                         ids=lambda p: p.name)
def test_summary_totals_agree_with_the_report(path):
  r = OverlapReport.from_hlo(path)
  text = str(r)
  assert f"{len(r.collectives)} collectives in the compiled schedule" in text
  assert "no schedule can hide" in text
