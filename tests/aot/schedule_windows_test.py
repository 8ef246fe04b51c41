"""`schedule.windows` on a committed real TPU text (no compiler needed).

tests/fixtures/hlo/real/tpu_fsdp_scan_value_and_grad-jax0.12.0.1.as_text.txt
is libtpu's v5e schedule of an fsdp_scan step; one of its gathers is an
async collective fusion chain (`async-collective-start`, two continuation
fusions `fusion.90`/`fusion.95` that carry its state beside fused compute,
`async-collective-done`). The continuations also take an async copy's
result (`copy-start.1`) as a compute operand, so a pairing that walks back
from the done through every operand finds that copy's start instead.
"""

from __future__ import annotations

import pathlib

import schedule

FIXTURE = (pathlib.Path(__file__).parents[1] / "fixtures" / "hlo" / "real" /
           "tpu_fsdp_scan_value_and_grad-jax0.12.0.1.as_text.txt")


def _named(text):
  comps = schedule.scheduled(text)
  return [(w.kind, comps[w.computation][w.start].name,
           comps[w.computation][w.done].name, w) for w in schedule.windows(text)]


def test_a_tpu_fusion_chain_is_paired_from_its_start_to_its_done():
  text = FIXTURE.read_text()
  chain = [(kind, start, w) for kind, start, done, w in _named(text)
           if done == "async-collective-done"]
  assert [(kind, start) for kind, start, _ in chain] == [
      ("all-gather", "async-collective-start")], chain
  between = [i.name for i in chain[0][2].between]
  # its continuations, and the matmuls scheduled in its window
  assert {"fusion.90", "fusion.95", "copy-start.1"} <= set(between), between
  assert chain[0][2].matmuls == 2, between


def test_every_window_is_a_collective_from_the_start_its_done_finishes():
  text = FIXTURE.read_text()
  comps = schedule.scheduled(text)
  windows = schedule.windows(text)
  assert sorted({w.kind for w in windows}) == ["all-gather", "all-to-all"]
  for w in windows:
    start, done = comps[w.computation][w.start], comps[w.computation][w.done]
    assert w.start < w.done, w
    if done.opcode.endswith("-done"):  # a native pair: the done reads its start
      assert done.operands[:1] == (start.name,), (start.name, done.line)
