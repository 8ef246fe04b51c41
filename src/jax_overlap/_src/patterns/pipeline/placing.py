"""The planner: each schedule's order (orders.py) placed on ticks, a
`PipelinePlan` (plan.py).

An action runs
at the first tick its inputs are there, a stage-to-stage send arriving
`send_ticks` ticks after the tick that made it. With `send_ticks=None` (what
`pipeline_loss` runs by default for 1F1B and interleaved) every tick holds one
kind of action, forward and backward ticks alternating where both are ready:
a send then has a tick of the other kind to be in flight over (only the
warm-up's and the drain's are waited for), the table has the literature's
tick count, and devices of a collective group never run different actions
(lockstep costs nothing). Zero-bubble's W's are placed
here: a device runs a pending W where its next F or I cannot run, or where an
F would hold more activations than 1F1B's stage 0 (so the peak stays
1F1B's).
ZB-V (`_place_zero_bubble_v`) has no fixed order: on its V (device d holds
stages d and 2p-1-d, actions.py) each device runs, of what is ready, a
forward under twice 1F1B's peak in chunks, else an I, else a pending W,
and a W first where its last forwards would otherwise miss the tick that
the bound leaves them; for m >= 2p its table is 6m+(1+s)(p-1) ticks with
sends of s=0 or 1 tick, the least any table on the V can be (device p-1
runs 6m actions and starts at tick (1+s)(p-1) at the earliest).
DualPipeV's order (orders.py) holds F&B cells, `Pair`s of a forward and a
backward run at one tick; a Pair waits for both parts' inputs. Pinned by
tests/patterns/pipeline/pipeline_schedule_test.py.
"""

from __future__ import annotations

from collections import deque

from jax_overlap._src.patterns.pipeline import orders as _orders
from jax_overlap._src.patterns.pipeline import plan
from jax_overlap._src.patterns.pipeline.actions import (F, I, W, Action, Pair,
                                                       device_chunk, parts,
                                                       placement_of)


#: The schedules whose default table has one kind of action a tick.
ALTERNATING = ("1f1b", "interleaved", "forward")


def default_send_ticks(schedule: str) -> int | None:
  """What `send_ticks=None` means for `schedule`: one kind a tick (None)
  for 1F1B and interleaved; a tick a send (1) for GPipe, whose sends all
  feed the next tick, ZB-H1 and ZB-V, whose W's fill ticks beside F's
  and I's, and DualPipeV, whose F&B cells hold both kinds."""
  return None if schedule in ALTERNATING else 1


def place(schedule: str, p: int, m: int, v: int, send_ticks: int | None,
          placement: str | None = None) -> plan.PipelinePlan:
  """Places the schedule's orders on ticks (see the module docstring).
  `placement`: where the stages sit, the schedule's by default (the
  forward-only plan of a ZB-V loss runs on the V)."""
  placement = placement or placement_of(schedule)
  if schedule == "zb-v":
    return _place_zero_bubble_v(p, m, send_ticks)
  if send_ticks is None:
    return _place_alternating(schedule, p, m, v, placement)
  order = _orders.orders(schedule, p, m, v, send_ticks)
  zero_bubble = schedule == "zb-h1"
  # zb-h1 keeps every device's live activations under 1F1B's peak, stage 0's
  # (Qi et al. count memory as the pipeline's peak, not each stage's).
  cap = min(m, (p - 1) * (1 + send_ticks) + 1)
  done_at: dict = {}
  pointer = [0] * p
  pending_w: list[deque] = [deque() for _ in range(p)]
  live = [0] * p
  todo = sum(len(o) for o in order) + (m * p if zero_bubble else 0)
  table = []
  limit = 8 * (todo + p * (send_ticks + 2))
  while todo:
    t = len(table)
    if t > limit:
      raise AssertionError(f"{schedule}: no progress placing ({p}, {m}, {v})")
    row: list[Action | Pair | None] = [None] * p
    for d in range(p):
      nxt = order[d][pointer[d]] if pointer[d] < len(order[d]) else None
      can = nxt is not None and _ready(
          plan.cell_deps(nxt, d, p, v, placement), done_at, d, t, send_ticks)
      if can and zero_bubble and nxt.kind == F and live[d] >= cap:
        can = False
      if can:
        row[d] = nxt
        pointer[d] += 1
      elif zero_bubble and pending_w[d]:
        row[d] = pending_w[d].popleft()
    todo -= _record(row, t, p, placement, done_at,
                    (live, pending_w) if zero_bubble else None)
    table.append(tuple(row))
  return plan.PipelinePlan(schedule, p, m, v, send_ticks, tuple(table), placement)


def _place_alternating(schedule: str, p: int, m: int, v: int,
                       placement: str = "chunk-major") -> plan.PipelinePlan:
  """One kind of action a tick: the kind not run the tick before where a
  device is ready for it, else the kind most devices are ready for. 1F1B's
  warm-up is its order for sends a tick long (2 (p-1-d) forwards on device
  d): the forwards of the steady state then alternate with backwards and the
  table is 2 (m+p-1) ticks."""
  order = _orders.orders(schedule, p, m, v, 1 if schedule == "1f1b" else 0)
  done_at: dict = {}
  pointer = [0] * p
  todo = sum(len(o) for o in order)
  table: list[tuple[Action | None, ...]] = []
  last_kind = None
  while todo:
    t = len(table)
    if t > 8 * (todo + p) + len(table):
      raise AssertionError(f"{schedule}: no progress placing ({p}, {m}, {v})")
    ready: dict[str, list[int]] = {}
    for d in range(p):
      nxt = order[d][pointer[d]] if pointer[d] < len(order[d]) else None
      if nxt is not None and _ready(plan.deps(nxt, d, p, v, placement),
                                    done_at, d, t, 0):
        ready.setdefault(nxt.kind, []).append(d)
    row: list[Action | None] = [None] * p
    if ready:
      kind = min(ready, key=lambda k: (k == last_kind, -len(ready[k])))
      for d in ready[kind]:
        row[d] = order[d][pointer[d]]
        pointer[d] += 1
        todo -= 1
        done_at[plan.key(row[d], d, p, placement)] = t
      last_kind = kind
    table.append(tuple(row))
  return plan.PipelinePlan(schedule, p, m, v, None, tuple(table), placement)


def pipeline_schedule(schedule: str, stages: int, microbatches: int,
                      virtual_stages: int = 1, *,
                      send_ticks: int | None = None) -> plan.PipelinePlan:
  """The table of a pipeline schedule: for each tick and stage, the action.

  Args:
    schedule: "gpipe", "1f1b", "interleaved" (Megatron's 1F1B over
      `virtual_stages` chunks a device), "zb-h1" (zero bubble: the backward
      split into its input gradient I and weight gradient W, each W run later
      to fill the bubbles) or "zb-v" (zero bubble on a V of two chunks a
      device: `virtual_stages=2`, device d holds stages d and 2p-1-d; under
      unit costs and m >= 2p its table is 6m+(1+s)(p-1) ticks with sends of s ticks,
      s = 0 or 1 (the default), the least any table on the V has: a bubble
      of (p-1)/(6m+p-1) with free sends, (p-1)/(3m+p-1) with a tick a send)
      or "dualpipev" (DeepSeek's DualPipe cut in
      half, on ZB-V's V, `virtual_stages=2`, m >= 2p: in the steady state a
      device runs a forward of one chunk and a backward of the other, of
      different microbatches, in one tick, an F&B cell printed `F3+B1.1`;
      under unit costs, an F&B costing F+B, each device idles 2(p-1) and
      holds at most 2p+1 chunk-microbatches).
    stages: p, devices along the pipeline axis (at least 2).
    microbatches: m.
    virtual_stages: v, chunks a device; global stage `j*p + d` is chunk j of
      device d (ZB-V, DualPipeV: 2, stage d chunk 0 and stage 2p-1-d chunk
      1).
    send_ticks: None (default): what `pipeline_loss` runs by default: for
      1F1B and interleaved one kind of action a tick, forward and backward
      ticks alternating, each send in flight over a tick of the other kind
      (the literature's tick count; only the warm-up's and the drain's sends
      are waited for); for GPipe, ZB-H1 and ZB-V 1. An int: ticks a send is in
      flight, each a tick of its own (0: the literature's tables with sends
      that take no time; 1: each send in flight while the next tick
      computes).

  Returns:
    A `PipelinePlan`: `print` it; `.simulate(forward=, backward_input=,
    backward_weight=)` gives `bubble_fraction` and `peak_activations`.

  Example:
    >>> import jax_overlap
    >>> plan = jax_overlap.pipeline_schedule("1f1b", 4, 8)
    >>> sim = plan.simulate()
    >>> plan.ticks, round(sim.bubble_fraction, 4), sim.peak_activations
    (22, 0.2727, (7, 5, 3, 1))
    >>> zbv = jax_overlap.pipeline_schedule("zb-v", 4, 8, 2, send_ticks=0)
    >>> sim = zbv.simulate()   # peaks in chunk-microbatches, half a stage each
    >>> zbv.ticks, round(sim.bubble_fraction, 4), sim.peak_activations
    (51, 0.0588, (8, 8, 8, 8))
    >>> zbv = jax_overlap.pipeline_schedule("zb-v", 4, 8, 2)   # a tick a send
    >>> zbv.ticks, round(zbv.simulate(send=0).bubble_fraction, 4)
    (54, 0.0588)
    >>> dpv = jax_overlap.pipeline_schedule("dualpipev", 4, 8, 2, send_ticks=0)
    >>> sim = dpv.simulate()   # an F&B cell costs its parts' sum
    >>> dpv.ticks, sim.makespan, round(sim.bubble_fraction, 4), sim.peak_activations
    (34, 54.0, 0.1111, (9, 9, 9, 9))
  """
  _orders.check_arguments(schedule, stages, microbatches, virtual_stages)
  if send_ticks is None:
    send_ticks = default_send_ticks(schedule)
  elif not isinstance(send_ticks, int) or isinstance(send_ticks, bool) \
      or send_ticks < 0:
    raise ValueError(f"send_ticks={send_ticks!r}: expected None or an int >= 0.")
  return place(schedule, stages, microbatches, virtual_stages, send_ticks)


#: ZB-V's preference on a device at a tick, of what can run: a forward
#: (under the cap), then an I; chunk 1's first (nearer the loss).
_V_PRIORITY = ((F, 1), (F, 0), (I, 1), (I, 0))


def _place_zero_bubble_v(p: int, m: int, send_ticks: int) -> plan.PipelinePlan:
  """ZB-V (Qi et al.): two chunks a device on a V (actions.py), each
  backward split into I and W, in the fewest ticks any table on the V has
  for sends of s = `send_ticks` = 0 or 1 tick: 6m + (1+s)(p-1) where m >=
  (1+s)(p-1)+1 (at s=1, m >= 2p-1), holding at most `cap` = 2 min(m,
  (1+s)(p-1)+1) chunk-microbatches a device: 1F1B's stage-0 peak under the
  same sends, in chunks (half a stage each). (Larger s: a valid table, not
  always the shortest.)

  Why no table is shorter: device p-1 runs 6m actions and cannot start
  before microbatch 0's forward has crossed p-1 sends, at tick (1+s)(p-1).
  Why it needs that memory: its first I (microbatch 0 on chunk 1) waits for
  the forward to reach the loss on device 0 and the gradient to come back,
  2(1+s)(p-1)+2 ticks after its start, and a device that never idles runs
  only forwards until then: 2(1+s)(p-1)+2 live chunk-microbatches (14 at
  p=4, s=1). With fewer microbatches than that needs, device p-1 idles the
  difference and so does the table: 2((1+s)(p-1)+1-m) ticks more.

  How: each device runs, of what can run, a forward (chunk 1's first) while
  it holds fewer than `cap` chunk-microbatches, else an I (chunk 1's first),
  else its oldest pending W; and it runs a W first where its forwards would
  otherwise be late: each forward has a latest tick (`_latest_forwards`:
  later, microbatch m-1 could not reach the loss and come back by the
  bound), and the n forwards due by a tick need live+n-cap W's before them
  to fit under the cap. So chunk 0's forwards fill the warm-up up to the
  cap, each device then turns them into I's as the gradients arrive, and
  the W's free memory just in time for the last forwards and fill the drain.
  Tests: tests/patterns/pipeline/pipeline_schedule_test.py
  (`test_zb_v_bubble_and_peak`, `test_zb_v_ticks_are_the_least_for_every_m`:
  the tick counts above for p in 2, 3, 4, 8, m from p to 4p, s = 0 and 1).

  Example:
    >>> zbv = _place_zero_bubble_v(4, 8, 1)
    >>> zbv.ticks, zbv.simulate().peak_activations   # 6m + 2(p-1)
    (54, (14, 14, 14, 14))
  """
  placement = "v"
  cap = 2 * min(m, (p - 1) * (1 + send_ticks) + 1)
  due = _latest_forwards(p, m, send_ticks)
  nxt = [dict.fromkeys(_V_PRIORITY, 0) for _ in range(p)]
  pending_w: list[deque] = [deque() for _ in range(p)]
  live = [0] * p
  done_at: dict = {}
  todo = 6 * m * p
  table: list[tuple[Action | None, ...]] = []
  while todo:
    t = len(table)
    if t > 8 * (6 * m * p + p * (send_ticks + 2)):
      raise AssertionError(f"zb-v: no progress placing ({p}, {m})")
    row: list[Action | None] = [None] * p
    for d in range(p):
      left = [m - nxt[d][F, c] for c in (0, 1)]
      if pending_w[d] and _free_a_row_now(live[d], cap, left, due[d], t):
        row[d] = pending_w[d].popleft()
        continue
      for kind, chunk in _V_PRIORITY:
        i = nxt[d][kind, chunk]
        if i >= m or (kind == F and live[d] >= cap):
          continue
        a = Action(kind, i, chunk)
        if _ready(plan.deps(a, d, p, 2, placement), done_at, d, t, send_ticks):
          row[d] = a
          nxt[d][kind, chunk] += 1
          break
      else:
        if pending_w[d]:
          row[d] = pending_w[d].popleft()
    todo -= _record(row, t, p, placement, done_at, (live, pending_w))
    table.append(tuple(row))
  return plan.PipelinePlan("zb-v", p, m, 2, send_ticks, tuple(table), placement)


def _latest_forwards(p: int, m: int, send_ticks: int) -> list[tuple[int, int]]:
  """Per device, the latest tick of its (chunk 0, chunk 1) forwards for a
  table of 6m + (1+s)(p-1) ticks: later, that microbatch's gradient could
  not come back to device 0 (stage 0's I, then its W) by the last tick."""
  hop = lambda g, h: 1 + (send_ticks if device_chunk(g, p, "v")[0]
                          != device_chunk(h, p, "v")[0] else 0)
  last = 6 * m + (1 + send_ticks) * (p - 1) - 1
  grad = [last - 1]                       # stage 0's I, before its W
  for g in range(1, 2 * p):
    grad.append(grad[-1] - hop(g, g - 1))
  forward = [0] * (2 * p)
  forward[-1] = grad[-1] - 1              # the loss stage's F, then its I
  for g in reversed(range(2 * p - 1)):
    forward[g] = forward[g + 1] - hop(g, g + 1)
  return [(forward[d], forward[2 * p - 1 - d]) for d in range(p)]


def _free_a_row_now(live: int, cap: int, left: list[int],
                    due: tuple[int, int], t: int) -> bool:
  """Whether a device holding `live` chunk-microbatches, with `left[c]`
  forwards of chunk c to run by tick `due[c]` each, must run a W at tick t:
  the n forwards due by a tick need live+n-cap W's before them, and those
  and the forwards do not fit in the ticks from t to it otherwise."""
  for c in (0, 1):
    n = sum(k for k, by in zip(left, due) if by <= due[c])
    if live + n > cap and 2 * n + live - cap > due[c] - t:
      return True
  return False


def _ready(deps, done_at: dict, d: int, t: int, send_ticks: int) -> bool:
  """Whether every input in `deps` is there at tick t on device d: made on d
  a tick before at least, sent from another device `send_ticks` more."""
  return all(key in done_at and
             done_at[key] + 1 + (send_ticks if dev != d else 0) <= t
             for key, dev in deps)


def _record(row, t: int, p: int, placement: str, done_at: dict,
            zero_bubble=None) -> int:
  """Notes what `row` (tick t's cells) makes in `done_at`; with
  `zero_bubble` = (live, pending_w), each device's live activations (an F
  adds one, a W ends one) and the W each I leaves pending. Returns how many
  cells ran."""
  ran = 0
  for d, cell in enumerate(row):
    if cell is None:
      continue
    ran += 1
    for a in parts(cell):
      done_at[plan.key(a, d, p, placement)] = t
    if zero_bubble is not None:
      live, pending_w = zero_bubble
      live[d] += {F: 1, W: -1}.get(cell.kind, 0)
      if cell.kind == I:
        pending_w[d].append(Action(W, cell.microbatch, cell.chunk))
  return ran
