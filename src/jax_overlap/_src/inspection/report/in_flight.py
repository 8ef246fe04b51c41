"""Bytes in flight: for each collective, the most bytes of collectives in
flight at once at any point of its window, its own included.

A window is the stretch of its computation's schedule from the start to
the done (both included). A pair whose done is in another computation (a
loop's next iteration, or after the loop) is in flight to the end of its
start's computation and from the beginning of its done's. Only collectives
on the same thread of the same computation are counted together: what
runs in a loop body is counted with the body's collectives, not with those
around the loop. Bytes are each pair's `bytes` (its result), so a
gather-heavy window reads as the gathered weights it holds in flight,
which is what `fsdp_scan(prefetch=...)` trades for earlier gathers.
"""

from __future__ import annotations

import bisect
import collections

from jax_overlap._src.inspection.reading.hlo_module import HloModule


def bytes_in_flight(pairs, module: HloModule) -> dict:
  """`pair.key -> bytes` for each pair of `pairs` (collectives)."""
  segments = collections.defaultdict(list)   # (comp, thread) -> [(lo, hi, b, key)]
  for p in pairs:
    for comp, lo, hi in _segments(p, module):
      segments[comp, p.thread].append((lo, hi, p.bytes, p.key))
  out = {p.key: p.bytes for p in pairs}
  for group in segments.values():
    los = sorted(s[0] for s in group)
    his = sorted(s[1] for s in group)
    by_lo = sorted(((s[0], s[2]) for s in group))
    by_hi = sorted(((s[1], s[2]) for s in group))
    lo_sums = _prefix([b for _, b in by_lo])
    hi_sums = _prefix([b for _, b in by_hi])

    def at(t):   # bytes of the segments with lo <= t <= hi
      started = lo_sums[bisect.bisect_right(los, t)]
      ended = hi_sums[bisect.bisect_left(his, t)]
      return started - ended
    points = sorted(set(los))
    for lo, hi, _, key in group:
      inside = points[bisect.bisect_left(points, lo):
                      bisect.bisect_right(points, hi)]
      out[key] = max([out[key]] + [at(t) for t in inside])
  return out


def _prefix(values):
  sums = [0.0]
  for v in values:
    sums.append(sums[-1] + v)
  return sums


def _segments(pair, module):
  comps = module.computations
  start_comp = comps.get(pair.computation)
  if start_comp is None or pair.start.name not in start_comp.position:
    return []
  lo = start_comp.position[pair.start.name]
  if pair.done is None:
    return [(pair.computation, lo, lo)]
  if pair.done_computation in (None, pair.computation) \
      and pair.done.name in start_comp.position:
    return [(pair.computation, lo, start_comp.position[pair.done.name])]
  out = [(pair.computation, lo, len(start_comp.instructions) - 1)]
  done_comp = comps.get(pair.done_computation)
  if done_comp is not None and pair.done.name in done_comp.position:
    out.append((pair.done_computation, 0, done_comp.position[pair.done.name]))
  return out
