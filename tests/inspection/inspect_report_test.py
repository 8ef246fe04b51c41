"""The report as a table (with and without rich), as data, and as pictures;
the docstring examples of the public names run."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from jax_overlap import OverlapReport
from jax_overlap._src.inspection.report import timeline
from jax_overlap._src.inspection.report.table import render

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"


@pytest.fixture(scope="module")
def pipelined():
  return OverlapReport.from_hlo(FIXTURES / "gpu_pipelined_send_recv.txt",
                                hardware="a100")


def test_plain_text_without_rich(monkeypatch, pipelined):
  monkeypatch.setitem(sys.modules, "rich", None)  # `import rich` fails
  text = pipelined.table()   # str() is the summary now
  assert "┃" not in text
  assert ("Collectives in the compiled schedule (times modelled on a100, "
          "not measured)") in text
  header = next(line for line in text.splitlines() if line.startswith("#"))
  # The table names each collective's source line and leaf (or unknown).
  assert header.split() == ["#", "kind", "source,", "leaf", "start", "->",
                            "done", "computation", "bytes", "overlapped",
                            "comm", "exposed", "runs", "flags"]
  assert "recv -> recv-done.p" in text and "spans iteration" in text
  assert "perfect schedule" in text


def test_rich_table(pipelined):
  pytest.importorskip("rich", reason="rich (the 'report' extra) is not "
                                     "installed")
  text = render(pipelined, use_rich=True, width=200)
  assert "-> recv-done.p" in text and "matmul_fusion" in text
  assert "───" in text


def test_to_dict_is_json_and_names_have_no_percent(pipelined):
  data = json.loads(pipelined.to_json())
  assert data == pipelined.to_dict()
  assert data["collectives"][2]["start"] == "recv"
  assert data["collectives"][2]["overlapped"] == ["matmul_fusion"]
  assert data["collectives"][2]["runs"] == 7
  assert "not measured" in data["modelled"]


def test_long_loops_are_drawn_with_their_steady_state(pipelined, tmp_path):
  categories = {e.category for e in pipelined.timeline.events}
  assert "loop" in categories   # 8 iterations: 3 drawn, the rest repeated
  trace = timeline.trace_events(pipelined)
  assert trace["otherData"]["note"] == "all times are modelled, not measured"
  last = max(e["ts"] + e["dur"] for e in trace["traceEvents"]
             if e["ph"] == "X")
  assert last == pytest.approx(pipelined.step_s * 1e6)
  pytest.importorskip("matplotlib", reason="matplotlib (the 'report' extra) "
                                           "is not installed")
  path = tmp_path / "loop.png"
  pipelined.save_timeline(path)
  assert path.read_bytes()[:4] == b"\x89PNG"


def test_timeline_without_matplotlib_says_what_to_install(monkeypatch,
                                                          pipelined, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match=r"pip install 'jax-overlap\[report\]'"):
    pipelined.save_timeline(tmp_path / "x.png")
