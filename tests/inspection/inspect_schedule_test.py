"""Reading GPU and TPU schedules: every collective, its window, loops, threads.

Each fixture under fixtures/hlo is written in the syntax of a real dump; the
tests pin the report's fields exactly.
"""

from __future__ import annotations

import pathlib

import pytest

from jax_overlap import OverlapReport

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"


def report(name: str, hardware: str = "h100") -> OverlapReport:
  return OverlapReport.from_hlo(FIXTURES / name, hardware=hardware)


def fields(record, *names):
  d = record.to_dict()
  return tuple(d[n] for n in names)


CORE = ("kind", "start", "done", "computation", "async", "bytes",
        "overlapped", "spans_iteration", "trip_count")


def test_gpu_prefetch_all_gather_overlaps_the_layer():
  r = report("gpu_prefetch.txt")
  assert [fields(c, *CORE) for c in r.collectives] == [
      ("all-gather", "all-gather-start", "all-gather-done", "main.42_spmd",
       True, 8192 * 8192 * 2,
       ["convert_fusion", "cublas-gemm.1", "tanh_fusion"], False, None),
      ("all-reduce", "all-reduce-start", "all-reduce-done", "main.42_spmd",
       True, 4096 * 8192 * 4, [], False, None),
  ]
  assert [c.group_size for c in r.collectives] == [8, 8]
  assert r.collectives[0].flags == []
  assert r.collectives[1].flags == ["overlaps nothing"]
  # The gather hides behind the layer; the all-reduce is all exposed, and no
  # schedule can hide it: it reduces the last gemm, which every op feeds. (The
  # serial-link figure, dependencies ignored, says 0.)
  assert r.collectives[0].exposed_s == 0
  assert r.collectives[1].exposed_s == r.collectives[1].comm_s
  assert r.totals["bound_exposed_s"] == pytest.approx(r.collectives[1].comm_s)
  assert r.totals["serial_link_bound_s"] == 0
  assert r.copies == [] and r.threads == ["main"]


def test_async_wrappers_take_the_kind_of_what_they_wrap():
  r = report("gpu_async_wrapped.txt")
  got = [fields(c, *CORE, "made_blocking", "group_size")
         for c in r.collectives]
  assert got == [
      ("reduce-scatter", "reduce-scatter-start", "reduce-scatter-done",
       "main.77_spmd", True, 128 * 512 * 2, ["gelu_fusion", "dot_fusion"],
       False, None, False, 8),
      ("all-to-all", "all-to-all-start", "all-to-all-done", "main.77_spmd",
       True, 8 * 64 * 512 * 2, [], False, None, False, 8),
      # async-start around a fusion holding an all-gather
      ("all-gather", "all-gather-start.2", "all-gather-done.2",
       "main.77_spmd", True, 1024 * 512 * 2, ["cublas-gemm.2"], False, None,
       False, 8),
      # async-start around a call holding an all-reduce
      ("all-reduce", "all-reduce-start.3", "all-reduce-done.3",
       "main.77_spmd", True, 1024 * 4, [], False, None, False, 4),
      ("collective-permute", "collective-permute-start",
       "collective-permute-done", "main.77_spmd", True, 1024 * 512 * 2,
       ["cublas-gemm.3"], False, None, False, 8),
      # is_sync=true: the backend runs the pair blocking; no window reported
      ("all-reduce", "all-reduce-start.4", "all-reduce-done.4",
       "main.77_spmd", False, 512 * 4, [], False, None, True, 8),
  ]
  # The wrapped ops are not collectives of their own.
  starts = {c.start for c in r.collectives}
  assert not starts & {"reduce-scatter.1", "all-to-all.1", "all-gather.7",
                       "all-reduce.9"}
  assert r.collectives[5].flags[0] == "made blocking by the backend"


def test_tpu_loop_pairs_in_the_body_and_across_the_loop():
  r = report("tpu_loop.txt", hardware="tpu-v5e")
  got = [fields(c, *CORE, "group_size", "loop", "runs")
         for c in r.collectives]
  assert got == [
      # started before the while, finished after it: the loop is the window
      ("all-gather", "all-gather-start.0", "all-gather-done.0",
       "main.9_spmd", True, 1024 * 1024 * 2, ["while.1"], True, 4, 8,
       "while.1", 1),
      ("all-gather", "all-gather-start.1", "all-gather-done.1", "while_body",
       True, 1024 * 1024 * 2, ["add_fusion"], False, 4, 8, "while.1", 4),
      # 4-tuple result with u32[] contexts; bytes are the done's shape
      ("collective-permute", "collective-permute-start.1",
       "collective-permute-done.1", "while_body", True, 256 * 1024 * 2,
       ["conv_fusion"], False, 4, 8, "while.1", 4),
      # iota groups [4,2]<=[2,4]T(1,0): groups of 2
      ("all-reduce", "all-reduce-start.1", "all-reduce-done.1", "while_body",
       True, 1024 * 4, [], False, 4, 2, "while.1", 4),
  ]
  assert r.collectives[0].flags == ["spans iteration"]
  assert r.collectives[3].flags == ["overlaps nothing"]


def test_pipelined_send_recv_span_iterations():
  r = report("gpu_pipelined_send_recv.txt", hardware="a100")
  got = [fields(c, "kind", "start", "done", "computation", "bytes",
                "overlapped", "spans_iteration", "trip_count", "runs")
         for c in r.collectives]
  data = 512 * 2048 * 4
  assert got == [
      # issued before the loop, finished in its first iteration
      ("recv", "recv.0", "recv-done.p", "main.21_spmd", data, [], True, 8, 1),
      ("send", "send.0", "send-done.p", "main.21_spmd", data, [], True, 8, 1),
      # issued in iteration i, finished in iteration i+1
      ("recv", "recv", "recv-done.p", "while_body", data, ["matmul_fusion"],
       True, 8, 7),
      # ...and, from the last iteration, after the loop
      ("recv", "recv", "recv-done.last", "while_body", data,
       ["matmul_fusion"], True, 8, 1),
      ("send", "send", "send-done.p", "while_body", data, [], True, 8, 7),
      ("send", "send", "send-done.last", "while_body", data, [], True, 8, 1),
  ]
  assert all(c.group_size == 4 for c in r.collectives)
  # Every recv issued (one before the loop, one per iteration) is finished
  # exactly once.
  assert sum(c.runs for c in r.collectives if c.kind == "recv") == 1 + 8


def test_threads_calls_and_async_copies():
  r = report("threads_and_copies.txt")
  got = [fields(c, *CORE, "thread") for c in r.collectives]
  assert got == [
      # call-start to a computation holding one all-reduce on "sparsecore"
      # (slice.1 stands alone: data movement is work in a window too)
      ("all-reduce", "call-start", "call-done", "main.5_spmd", True,
       65536 * 4, ["matmul_fusion", "slice.1", "relu_fusion"], False, None,
       "sparsecore"),
      # a pair inside work with its own schedule on thread "parallel"
      ("all-gather", "all-gather-start.p", "all-gather-done.p",
       "parallel_work", True, 4096 * 4, [], False, None, "parallel"),
  ]
  assert r.threads == ["main", "parallel", "sparsecore"]
  assert r.collectives[0].flags == ["thread sparsecore"]
  assert [c.to_dict() for c in r.copies] == [{
      "start": "copy-start", "done": "copy-done", "computation": "main.5_spmd",
      "thread": "main", "bytes": 2048 * 1024 * 4,
      "overlapped": ["matmul_fusion", "slice.1", "relu_fusion"], "spans_iteration": False,
      "trip_count": None, "loop": None, "runs": 1,
      "copy_s": r.copies[0].copy_s, "exposed_s": 0, "flags": ["thread main"]}]
  assert any("threads main, parallel, sparsecore" in n for n in r.notes)


def test_synchronous_collectives_names_without_percent_and_group_forms():
  r = report("sync_collectives.txt")
  got = [fields(c, "kind", "start", "done", "async", "made_blocking",
                "group_size", "bytes", "overlapped") for c in r.collectives]
  assert got == [
      ("all-reduce", "all-reduce.1", "all-reduce.1", False, False, 2,
       64 * 32 * 4, []),
      # our future, compiled blocking (its op_name says collective_start)
      ("all-gather", "collective_start.4", "collective_start.4", False, True,
       8, 64 * 32 * 4, []),
      # replica_groups={} means every device: num_partitions=8
      ("reduce-scatter", "reduce-scatter.3", "reduce-scatter.3", False,
       False, 8, 8 * 32 * 4, []),
      ("all-to-all", "all-to-all.4", "all-to-all.4", False, False, 4,
       64 * 32 * 4, []),
      # async_collective_name says it was meant to be async
      ("collective-permute", "collective-permute.5", "collective-permute.5",
       False, True, 2, 8 * 32 * 4, []),
      ("all-gather", "all-gather.6", "all-gather.6", False, False, 8,
       64 * 32 * 4, []),
  ]
  # A blocking collective waits for all of its transfer.
  for c in r.collectives:
    assert c.exposed_s == pytest.approx(c.comm_s)


@pytest.mark.parametrize("name", [
    "gpu_prefetch.txt", "gpu_async_wrapped.txt", "tpu_loop.txt",
    "gpu_pipelined_send_recv.txt", "threads_and_copies.txt",
    "sync_collectives.txt"])
@pytest.mark.parametrize("hardware", ["h100", "a100", "tpu-v5e", "tpu-v5p"])
def test_totals_add_up_and_bound_is_below_exposed(name, hardware):
  r = report(name, hardware)
  t = r.totals
  assert t["comm_s"] == pytest.approx(sum(c.comm_s for c in r.collectives))
  assert t["exposed_s"] == pytest.approx(
      sum(c.exposed_s for c in r.collectives))
  assert 0 <= t["bound_exposed_s"] <= t["exposed_s"] * (1 + 1e-9)
  assert t["bound_exposed_s"] <= t["comm_s"] * (1 + 1e-9)
  if len(r.threads) == 1:  # compute on other threads runs alongside
    assert r.step_s >= r.compute_s * (1 - 1e-12)
  for c in r.collectives:
    assert c.comm_s > 0 and c.exposed_s >= 0 and c.runs >= 1


def test_sugared_async_ops_and_a_directly_wrapped_all_gather():
  r = OverlapReport.from_hlo("""HloModule m, is_scheduled=true, num_partitions=4
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%wrapped_all_gather (p0: f32[256]) -> f32[1024] {
  %p0 = f32[256]{0} parameter(0)
  ROOT %ag = f32[1024]{0} all-gather(%p0), replica_groups={{0,1,2,3}}, dimensions={0}
}
%fused_exp (p1: f32[1024]) -> f32[1024] {
  %p1 = f32[1024]{0} parameter(0)
  ROOT %e = f32[1024]{0} exponential(%p1)
}
ENTRY %main (x: f32[1024], y: f32[256]) -> (f32[256], f32[1024], f32[1024]) {
  %x = f32[1024]{0} parameter(0)
  %y = f32[256]{0} parameter(1)
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(%x), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %exp_fusion = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_exp
  %reduce-scatter-update = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-update(%reduce-scatter-start)
  %reduce-scatter-done = f32[256]{0} reduce-scatter-done(%reduce-scatter-update)
  %all-gather-start = ((f32[256]{0}), f32[1024]{0}) async-start(%y), calls=%wrapped_all_gather
  %all-gather-done = f32[1024]{0} async-done(%all-gather-start)
  ROOT %t = (f32[256], f32[1024], f32[1024]) tuple(%reduce-scatter-done, %all-gather-done, %exp_fusion)
}
""")
  assert [fields(c, *CORE, "group_size") for c in r.collectives] == [
      ("reduce-scatter", "reduce-scatter-start", "reduce-scatter-done", "main",
       True, 256 * 4, ["exp_fusion"], False, None, 4),
      ("all-gather", "all-gather-start", "all-gather-done", "main", True,
       1024 * 4, [], False, None, 4),
  ]
