"""The modelled timeline: the schedule laid out in order with the model's times.

One compute stream runs compute instructions back to back in schedule
order. Transfers run on links (`links.py`): each direction of point-to-point
traffic, the other collectives, each execution thread and stream, and the
copy engine have their own; what shares a link runs one at a time, in issue
order. A start issues its transfer (it begins when its link is free); the
done waits until it has finished. That wait is the collective's *exposed*
time. A synchronous collective (or one the backend made blocking) waits for
all of its transfer. A transfer that began later than it was issued waited
for the one holding its link: its totals name that one (`queued_behind`),
which is the only way its exposed time can pass its own transfer time.

Loops run their trip count (1 when unknown). Past three iterations, the
second is taken as the steady state: iterations 3 to n-1 repeat its times
and totals, and the last one is run again, so a start in one iteration and
its done in the next are timed as in the middle of the loop. A conditional
runs its costliest branch; a call runs inline; an async call on another
thread runs its computation from start to done beside the caller.

The *bound* is what a perfect schedule of the same program could not hide,
given its data dependencies (`dependency_bound.py`), summed over each run of
each scheduled computation. The *serial-link bound*, the figure reports gave
before, is for each run of each computation C `max(0, comm(C) -
compute(C))`: all of C's collectives on one link, dependencies ignored.
"""

from __future__ import annotations

import collections
import dataclasses

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.model import links
from jax_overlap._src.inspection.model.cost_model import CostModel
from jax_overlap._src.inspection.model.dependency_bound import (
    Dependencies, Transfer, computation_bound)
from jax_overlap._src.inspection.reading.hlo_module import MAIN_THREAD
from jax_overlap._src.inspection.schedule.pairing import Pair, Schedule

_STEADY_AFTER = 3  # loops longer than this repeat their second iteration


@dataclasses.dataclass
class Event:
  """One bar of the timeline. `category` is 'compute', 'wait' (the compute
  stream stalled on a done), 'in flight' (start to done), 'transfer' (the
  link busy), 'exposed' (the stall, on the collective's row) or 'loop'
  (iterations repeated from the steady state)."""

  row: str
  name: str
  start: float
  end: float
  category: str


@dataclasses.dataclass
class PairTotals:
  runs: float = 0.0
  seconds: float = 0.0
  exposed: float = 0.0
  link: str = ""
  #: start names of the transfers this one waited for on its link
  queued_behind: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Timeline:
  totals: dict[tuple[str, str | None], PairTotals]
  compute_s: float
  step_s: float
  bound_exposed_s: float
  serial_link_bound_s: float
  events: list[Event]
  events_dropped: int
  rows: list[str]


@dataclasses.dataclass
class _Flight:
  issue: float
  begin: float
  finish: float
  seconds: float
  blocked: float = 0.0


@dataclasses.dataclass
class _Frame:
  name: str
  compute_at_entry: float
  loop_body: bool = False
  comm: float = 0.0
  #: modelled compute seconds of each instruction of this run
  durations: dict[str, float] = dataclasses.field(
      default_factory=lambda: collections.defaultdict(float))
  transfers: list[Transfer] = dataclasses.field(default_factory=list)


def compute_row(thread: str) -> str:
  return "compute" if thread == MAIN_THREAD else f"compute [{thread}]"


def pair_row(pair: Pair) -> str:
  return f"{pair.kind} {pair.start.name}"


def simulate(schedule: Schedule, model: CostModel,
             max_events: int = 20000) -> Timeline:
  """Runs the model over `schedule`; see the module docstring."""
  return _Simulator(schedule, model, max_events).run()


class _Simulator:

  def __init__(self, schedule: Schedule, model: CostModel, max_events: int):
    self.s, self.model, self.max_events = schedule, model, max_events
    self.comps = schedule.module.computations
    self.now = 0.0
    #: link -> (when it is free, the start name of the last transfer on it)
    self.link_free: dict[str, tuple[float, str]] = {}
    self.compute = 0.0
    self.bound = 0.0
    self.serial_bound = 0.0
    self._deps: dict[tuple[str, bool], Dependencies] = {}
    self._bounds: dict[tuple[str, bool], float] = {}
    self.totals = collections.defaultdict(PairTotals)
    self.in_flight: dict[tuple[str, str], collections.deque] = {}
    self.frames: list[_Frame] = []
    self.events: list[Event] = []
    self.dropped = 0
    self.rows: list[str] = []
    self._row_set: set[str] = set()

  def run(self) -> Timeline:
    entry = self.s.module.entry
    self._computation(entry.name, self.s.schedules[entry.name])
    return Timeline(dict(self.totals), self.compute, self.now, self.bound,
                    self.serial_bound, self.events, self.dropped, self.rows)

  # --- recording --------------------------------------------------------------

  def _event(self, row, name, start, end, category):
    if row not in self._row_set:
      self._row_set.add(row)
      self.rows.append(row)
    if end <= start and category != "compute":
      return
    if len(self.events) >= self.max_events:
      self.dropped += 1
      return
    self.events.append(Event(row, name, start, end, category))

  # --- computations and instructions ----------------------------------------

  def _computation(self, name: str, thread: str,
                   loop_body: bool = False) -> None:
    frame = _Frame(name, self.compute, loop_body)
    self.frames.append(frame)
    comp = self.comps[name]
    for instr in comp.instructions:
      before = self.compute
      self._step(comp, instr, thread)
      if self.compute > before:
        frame.durations[instr.name] += self.compute - before
    self.frames.pop()
    compute = self.compute - frame.compute_at_entry
    self.serial_bound += max(0.0, frame.comm - compute)
    self.bound += self._dependency_bound(comp, frame)

  def _dependency_bound(self, comp, frame) -> float:
    if not frame.transfers:
      return 0.0
    # Every run of a computation has the same instructions and costs.
    key = (comp.name, frame.loop_body)
    if key not in self._bounds:
      if key not in self._deps:
        self._deps[key] = Dependencies(comp, frame.loop_body)
      self._bounds[key] = computation_bound(
          self._deps[key], dict(frame.durations), frame.transfers)
    return self._bounds[key]

  def _step(self, comp, instr, thread) -> None:
    key = (comp.name, instr.name)
    started = self.s.pairs_by_start.get(key)
    finished = self.s.pairs_by_done.get(key)
    if started and started[0].done is started[0].start:
      self._synchronous(started[0], thread)
      return
    if started:
      self._issue(comp, started, thread)
    if finished:
      self._finish(finished, thread)
    if started or finished:
      return
    op = instr.opcode
    if op == "while":
      self._loop(instr, thread)
    elif op == "call":
      for callee in instr.callees("to_apply"):
        self._computation(callee, thread)
    elif op == "conditional":
      branches = instr.callees("branch_computations", "true_computation",
                               "false_computation")
      if branches:
        self._computation(max(branches, key=self._static_compute), thread)
    elif self.s.is_compute(instr):
      seconds = self.model.compute_seconds(instr, comp)
      self._event(compute_row(thread), instr.name, self.now,
                  self.now + seconds, "compute")
      self.now += seconds
      self.compute += seconds

  def _static_compute(self, comp_name: str) -> float:
    comp = self.comps[comp_name]
    return sum(self.model.compute_seconds(i, comp) for i in comp.instructions
               if i.opcode not in ("while", "call", "conditional")
               and self.s.is_compute(i))

  # --- collectives, copies, async calls -----------------------------------------

  def _transfer(self, pair: Pair) -> tuple[float, float, float]:
    """(seconds, begin, finish) of `pair` issued now, on its link."""
    link = links.link_of(pair, self.s.module)
    if pair.role == "copy":
      seconds = self.model.copy_seconds(pair.bytes, pair.start)
    else:
      seconds = self.model.collective_seconds(pair.kind, pair.bytes,
                                              pair.group_size)
      frame = self.frames[-1]
      frame.comm += seconds
      frame.transfers.append(self._dependency_view(pair, frame, seconds, link))
    free, holder = self.link_free.get(link, (0.0, ""))
    begin = max(self.now, free)
    totals = self.totals[pair.key]
    totals.link = link
    # Waiting a hair (float noise of the steady-state shift) is not queueing.
    if free - self.now > 1e-3 * seconds + 1e-12 and holder != pair.start.name \
        and holder not in totals.queued_behind:
      totals.queued_behind.append(holder)
    self.link_free[link] = (begin + seconds, pair.start.name)
    return seconds, begin, begin + seconds

  def _dependency_view(self, pair, frame, seconds, link) -> Transfer:
    """How the bound sees `pair` from the computation that starts it."""
    kinds = [m[0] for m in pair.moves]
    if pair.done is not None and pair.done_computation == frame.name and (
        kinds in ([], ["enter", "exit"])):
      return Transfer(pair.start.name, pair.done.name, seconds, link)
    if kinds == ["enter"]:   # done inside the body of a loop of this computation
      body = self.comps[pair.done_computation]
      before = body.instructions[:body.position[pair.done.name]]
      lead = sum(self._static_compute_of(i, body) for i in before)
      return Transfer(pair.start.name, None, seconds, link,
                      consumer=pair.moves[0][1], lead_s=lead)
    # Done in a later iteration or after the loop: nothing here uses it.
    return Transfer(pair.start.name, None, seconds, link)

  def _static_compute_of(self, instr, comp) -> float:
    if instr.opcode in ("while", "call", "conditional"):
      return sum(self._static_compute(c) for c in instr.callees())
    return self.model.compute_seconds(instr, comp) if self.s.is_compute(
        instr) else 0.0

  def _synchronous(self, pair: Pair, thread: str) -> None:
    seconds, begin, finish = self._transfer(pair)
    row = pair_row(pair)
    self._event(row, pair.start.name, begin, finish, "transfer")
    self._stall(pair, row, thread, finish)
    totals = self.totals[pair.key]
    totals.runs += 1
    totals.seconds += seconds
    totals.exposed += max(0.0, finish - self.now)
    self.now = max(self.now, finish)

  def _stall(self, pair, row, thread, until) -> None:
    if until > self.now:
      self._event(row, f"exposed {pair.start.name}", self.now, until,
                  "exposed")
      self._event(compute_row(thread), f"wait {pair.start.name}", self.now,
                  until, "wait")

  def _issue(self, comp, pairs: list[Pair], thread: str) -> None:
    pair = pairs[0]
    if pair.role == "call":
      issue = self.now
      self._computation(pair.callee, pair.thread)
      flight = _Flight(issue, issue, self.now, 0.0)
      self.now = issue
    else:
      seconds, begin, finish = self._transfer(pair)
      flight = _Flight(self.now, begin, finish, seconds)
      if pair.made_blocking:  # the backend runs it whole at its start
        self._stall(pair, pair_row(pair), thread, finish)
        flight.blocked = max(0.0, finish - self.now)
        self.now = max(self.now, finish)
    self.in_flight.setdefault((comp.name, pair.start.name),
                              collections.deque()).append(flight)

  def _finish(self, pairs: list[Pair], thread: str) -> None:
    best = None
    for pair in pairs:
      queue = self.in_flight.get((pair.computation, pair.start.name))
      if queue and (best is None or queue[0].issue < best[1].issue):
        best = (pair, queue[0], queue)
    if best is None:
      return
    pair, flight, queue = best
    queue.popleft()
    totals = self.totals[pair.key]
    totals.runs += 1
    totals.seconds += flight.seconds
    totals.exposed += flight.blocked + max(0.0, flight.finish - self.now)
    if pair.role == "copy" and flight.finish > self.now:
      # The stream waits on the copy: time no collective is charged for,
      # which the dependency bound counts like compute at the copy's done.
      self.frames[-1].durations[pair.done.name] += flight.finish - self.now
    if pair.role != "call":
      row = pair_row(pair)
      self._event(row, pair.start.name, flight.issue, self.now, "in flight")
      self._event(row, f"transfer {pair.start.name}", flight.begin,
                  flight.finish, "transfer")
      self._stall(pair, row, thread, flight.finish)
    self.now = max(self.now, flight.finish)

  # --- loops --------------------------------------------------------------------

  def _loop(self, instr, thread) -> None:
    body = instr.callees("body")
    condition = instr.callees("condition")
    trip = attrs.known_trip_count(instr)
    n = 1 if trip is None else trip

    def iteration():
      for name in condition:
        self._computation(name, thread)
      for name in body:
        self._computation(name, thread, loop_body=n > 1)

    if n <= _STEADY_AFTER:
      for _ in range(n):
        iteration()
    else:
      iteration()
      before, started = self._snapshot(), self.now
      iteration()
      repeat = n - _STEADY_AFTER
      span = (self.now - started) * repeat
      self._add_scaled(before, self._snapshot(), repeat)
      self._shift(started, span)
      self._event(compute_row(thread),
                  f"{instr.name}: {repeat} more iterations like the last",
                  self.now, self.now + span, "loop")
      self.now += span
      iteration()
    for name in condition:
      self._computation(name, thread)

  def _snapshot(self):
    return ({k: (v.runs, v.seconds, v.exposed) for k, v in self.totals.items()},
            self.compute, self.bound, self.serial_bound)

  def _add_scaled(self, before, after, repeat) -> None:
    totals_before, compute_before, bound_before, serial_before = before
    totals_after, compute_after, bound_after, serial_after = after
    for key, (runs, seconds, exposed) in totals_after.items():
      r0, s0, e0 = totals_before.get(key, (0.0, 0.0, 0.0))
      totals = self.totals[key]
      totals.runs += (runs - r0) * repeat
      totals.seconds += (seconds - s0) * repeat
      totals.exposed += (exposed - e0) * repeat
    self.compute += (compute_after - compute_before) * repeat
    self.bound += (bound_after - bound_before) * repeat
    self.serial_bound += (serial_after - serial_before) * repeat

  def _shift(self, since: float, delta: float) -> None:
    for queue in self.in_flight.values():
      for flight in queue:
        if flight.issue >= since:
          flight.issue += delta
          flight.begin += delta
          flight.finish += delta
    for link, (free, holder) in self.link_free.items():
      if free > since:
        self.link_free[link] = (free + delta, holder)
