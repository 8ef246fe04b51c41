"""The report's `bytes_in_flight`: the most bytes of collectives in flight
at once during each one's window, its own included (report/in_flight.py)."""

from __future__ import annotations

import pathlib

from jax_overlap import OverlapReport

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"

_CFG = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
        '"collective_backend_config":{"is_sync":false}}')

# Two gathers started before one matmul (a prefetch two layers deep) and a
# third started after the first is done: 64 KiB + 128 KiB in flight at once,
# then 128 KiB + 32 KiB.
TWO_DEEP = f"""HloModule two_deep, is_scheduled=true, num_partitions=8

ENTRY %main (a: f32[8,256], b: f32[16,256], c: f32[4,256], x: f32[64,64]) -> f32[64,64] {{
  %a = f32[8,256]{{1,0}} parameter(0)
  %b = f32[16,256]{{1,0}} parameter(1)
  %c = f32[4,256]{{1,0}} parameter(2)
  %x = f32[64,64]{{1,0}} parameter(3)
  %ag-a = (f32[8,256]{{1,0}}, f32[64,256]{{1,0}}) all-gather-start(f32[8,256]{{1,0}} %a), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true, {_CFG}
  %ag-b = (f32[16,256]{{1,0}}, f32[128,256]{{1,0}}) all-gather-start(f32[16,256]{{1,0}} %b), channel_id=2, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true, {_CFG}
  %dot.1 = f32[64,64]{{1,0}} dot(f32[64,64]{{1,0}} %x, f32[64,64]{{1,0}} %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %done-a = f32[64,256]{{1,0}} all-gather-done((f32[8,256]{{1,0}}, f32[64,256]{{1,0}}) %ag-a)
  %ag-c = (f32[4,256]{{1,0}}, f32[32,256]{{1,0}}) all-gather-start(f32[4,256]{{1,0}} %c), channel_id=3, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true, {_CFG}
  %dot.2 = f32[64,64]{{1,0}} dot(f32[64,64]{{1,0}} %dot.1, f32[64,64]{{1,0}} %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %done-b = f32[128,256]{{1,0}} all-gather-done((f32[16,256]{{1,0}}, f32[128,256]{{1,0}}) %ag-b)
  %done-c = f32[32,256]{{1,0}} all-gather-done((f32[4,256]{{1,0}}, f32[32,256]{{1,0}}) %ag-c)
  ROOT %out = f32[64,64]{{1,0}} add(f32[64,64]{{1,0}} %dot.2, f32[64,64]{{1,0}} %x)
}}
"""


def test_bytes_in_flight_counts_the_windows_that_overlap():
  report = OverlapReport.from_hlo(TWO_DEEP, hardware="h100")
  got = {c.start: (c.bytes, c.bytes_in_flight) for c in report.collectives}
  kib = 1024
  assert got == {"ag-a": (64 * kib, 192 * kib),     # a and b
                 "ag-b": (128 * kib, 192 * kib),    # a and b, then b and c
                 "ag-c": (32 * kib, 160 * kib)}, got
  assert report.collectives[0].to_dict()["bytes_in_flight"] == 192 * kib


def test_a_window_alone_holds_its_own_bytes():
  report = OverlapReport.from_hlo(FIXTURES / "gpu_prefetch.txt")
  assert report.collectives
  for c in report.collectives:   # the gather and the all-reduce never overlap
    assert c.bytes_in_flight == c.bytes, c
