"""From timed events to measured records: each collective's time, the part
hidden behind compute on the same device, and what is left exposed.

Per device, compute is the union of its compute events over every stream (two
streams busy at once count once). A collective's occurrence is the union of
its kernels from one run of the instruction: consecutive kernels of the same
op on one stream, until another op's event starts on that device after them
(or the run id changes). So a collective of several kernels runs once, and a
collective in a loop runs once per iteration.

Where the profile has an event per async pair (TPU's "Async XLA Ops", from
the start to the done), that event is the collective's occurrence, one per
pair, and the start's and done's own events are parts of it: neither
compute nor a collective of their own. The compute inside the pair's window
is what it hid.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from jax_overlap._src.inspection.measured import intervals as iv
from jax_overlap._src.inspection.measured.classify import OpKinds
from jax_overlap._src.inspection.measured.xplane import TimedEvent

CUDA_GRAPHS_OFF = "XLA_FLAGS=--xla_gpu_enable_command_buffer="
WAIT_FLAG_MIN_S = 1e-6


@dataclasses.dataclass
class Occurrence:
  key: tuple[str | None, str]  # (module, instruction)
  kind: str
  line: str
  run_id: int | None
  spans: list[tuple[float, float]]
  named_by_kernel: bool

  @property
  def start(self) -> float:
    return self.spans[0][0]

  @property
  def end(self) -> float:
    return max(e for _, e in self.spans)


@dataclasses.dataclass
class DeviceTimeline:
  """One device's compute union and collective occurrences."""
  device: int
  compute: list[tuple[float, float]]
  compute_lines: set[str]
  occurrences: list[Occurrence]


def device_timelines(events: list[TimedEvent],
                     kinds: dict[str | None, OpKinds]) -> list[DeviceTimeline]:
  """Each device's timeline; `kinds` maps a module name to its classifier
  (None: by names)."""
  by_device: dict[int, list[TimedEvent]] = defaultdict(list)
  for e in events:
    by_device[e.device].append(e)
  out = []
  for device in sorted(by_device):
    out.append(_timeline(device, sorted(by_device[device],
                                        key=lambda e: (e.start, e.end)), kinds))
  return out


def _pair_halves(events) -> set[tuple]:
  """(module, instruction) of each start and done that a pair's event spans."""
  return {(e.module, op) for e in events if e.done is not None
          for op in (e.hlo_op, e.done)}


def _timeline(device, events, kinds) -> DeviceTimeline:
  compute, compute_lines, occurrences = [], set(), []
  open_: dict[tuple, Occurrence] = {}
  line_last: dict[str, tuple] = {}
  halves = _pair_halves(events)
  for e in events:
    if e.done is None and (e.module, e.hlo_op) in halves:
      continue                      # a start's or done's own event: in its pair's
    classify = kinds.get(e.module) or kinds.get(None) or OpKinds(None)
    kind = classify.collective_kind(e.hlo_op, e.name, e.opcode)
    key = (e.module, classify.instruction(e.hlo_op) if e.hlo_op
           else e.name.split("(")[0])
    if e.done is not None:          # an async pair's span: one occurrence
      if kind is not None:
        occurrences.append(Occurrence(key, kind, e.line, e.run_id,
                                      [(e.start, e.end)], named_by_kernel=False))
      continue
    # Another op's event starting after an open occurrence's kernels closes it.
    for k in [k for k, occ in open_.items() if k != key and e.start >= occ.end]:
      del open_[k]
    if kind is None:
      if classify.is_compute(e.hlo_op, e.opcode) and e.end > e.start:
        compute.append((e.start, e.end))
        compute_lines.add(e.line)
      line_last[e.line] = key
      continue
    occ = open_.get(key)
    if (occ is not None and occ.line == e.line and occ.run_id == e.run_id
        and line_last.get(e.line) == key):
      occ.spans.append((e.start, e.end))
    else:
      occ = Occurrence(key, kind, e.line, e.run_id, [(e.start, e.end)],
                       named_by_kernel=e.hlo_op is None)
      open_[key] = occ
      occurrences.append(occ)
    line_last[e.line] = key
  return DeviceTimeline(device, iv.union(compute), compute_lines, occurrences)


@dataclasses.dataclass
class Measured:
  """One collective instruction on one device, over every run measured."""
  module: str | None
  name: str
  kind: str
  device: int
  runs: int
  measured_s: float
  hidden_s: float
  waiting_s: float
  lines: list[str]
  on_compute_stream: bool
  named_by_kernel: bool


def measure_timelines(timelines: list[DeviceTimeline]) -> list[Measured]:
  """A `Measured` per (module, instruction, device) that ran."""
  waits = _waiting(timelines)
  out = []
  for t in timelines:
    per_key: dict[tuple, list[Occurrence]] = defaultdict(list)
    for occ in t.occurrences:
      per_key[occ.key].append(occ)
    for key, occs in per_key.items():
      measured = hidden = 0.0
      for occ in occs:
        spans = iv.union(occ.spans)
        measured += iv.length(spans)
        hidden += iv.length(iv.intersect(spans, t.compute))
      lines = sorted({o.line for o in occs})
      out.append(Measured(
          module=key[0], name=key[1], kind=occs[0].kind, device=t.device,
          runs=len(occs), measured_s=measured, hidden_s=hidden,
          waiting_s=waits.get((t.device, key), 0.0), lines=lines,
          on_compute_stream=bool(set(lines) & t.compute_lines),
          named_by_kernel=occs[0].named_by_kernel))
  return out


def _waiting(timelines) -> dict[tuple, float]:
  """(device, key) -> time spent before the last device of the same
  occurrence (the k-th run on each device) started."""
  starts: dict[tuple, dict[int, list[Occurrence]]] = defaultdict(dict)
  for t in timelines:
    for occ in t.occurrences:
      starts[occ.key].setdefault(t.device, []).append(occ)
  out: dict[tuple, float] = defaultdict(float)
  for key, per_device in starts.items():
    if len(per_device) < 2:
      continue
    for k in range(min(len(v) for v in per_device.values())):
      latest = max(v[k].start for v in per_device.values())
      for device, v in per_device.items():
        occ = v[k]
        out[(device, key)] += max(0.0, min(latest, occ.end) - occ.start)
  return out


def device_totals(timelines: list[DeviceTimeline]) -> dict[int, dict]:
  """Per device: `comm_s` (the union of its collectives), `hidden_s` (of that,
  the part during which compute ran), `exposed_s`, `overlap_fraction`
  (hidden / comm; None without communication) and `compute_s`."""
  out = {}
  for t in timelines:
    comm = iv.union(s for occ in t.occurrences for s in occ.spans)
    comm_s = iv.length(comm)
    hidden_s = iv.length(iv.intersect(comm, t.compute))
    out[t.device] = {
        "comm_s": comm_s, "hidden_s": hidden_s, "exposed_s": comm_s - hidden_s,
        "overlap_fraction": hidden_s / comm_s if comm_s > 0 else None,
        "compute_s": iv.length(t.compute)}
  return out


def flags(m: Measured, backend: str, is_async: bool) -> list[str]:
  """What the reader should know about one measured collective."""
  out = []
  if m.named_by_kernel:
    out.append("no hlo_op on its kernel: named and classified by the kernel name")
  if m.on_compute_stream and backend != "cpu":
    out.append(f"on the compute stream ({', '.join(m.lines)}): it cannot "
               "overlap that stream's compute")
  if m.waiting_s > max(WAIT_FLAG_MIN_S, 0.01 * m.measured_s):
    out.append(f"includes {m.waiting_s * 1e6:.0f} us waiting for peers "
               "(the other devices started it later)")
  if m.measured_s > 0 and m.hidden_s == 0 and (backend == "cpu" or not is_async):
    out.append("blocking on this backend: no compute ran beside it")
  elif m.measured_s > 0 and m.hidden_s == 0:
    out.append("overlapped nothing")
  return out


def no_kernel_flag(backend: str) -> str:
  if backend == "gpu":
    return ("no kernel found: the instruction is in the module but no event ran "
            "it; CUDA graphs (command buffers) hide their kernels from the "
            f"profile: rerun with {CUDA_GRAPHS_OFF} to turn them off")
  return "no kernel found: the instruction is in the module but no event ran it"
