"""The short report: totals, the collectives that expose the most, and what
to change (`print(report)`, `jax-overlap inspect FILE`).

Plain lines, never cut at any width: each collective is two lines (what it
is and what it cost; where it comes from and its flags), so the output reads
the same on a terminal, in a pipe and in a log.
"""

from __future__ import annotations

import os

from jax_overlap._src.inspection.report.table import (
    format_bytes, format_seconds)
from jax_overlap._src.patterns.pipeline import tick_names

#: How many collectives the summary lists.
TOP = 5
#: Below this a transfer is all latency on every built-in profile.
SMALL_BYTES = 64 * 2**10

_FUTURE = {"all-gather": "all_gather_start", "all-reduce": "psum_start",
           "reduce-scatter": "psum_scatter_start",
           "all-to-all": "all_to_all_start",
           "collective-permute": "ppermute_start"}
#: The flag `analysis.py` gives a blocking collective autodiff wrote.
FROM_AUTODIFF = "from autodiff"
#: What to change for a collective autodiff wrote, by kind: the forward
#: operation it is the gradient of.
_AUTODIFF_CHANGE = {
    "all-reduce": (
        "they sum the gradients of inputs replicated over the mesh axis "
        "(in_specs P() inside shard_map): shard those weights over the axis "
        "(with fsdp_scan each gradient is then a reduce-scatter in flight "
        "behind the backward pass); psum_start cannot go where autodiff "
        "writes the sum"),
    "reduce-scatter": (
        "they are the gradients of jax.lax.all_gather calls: start those "
        "gathers with jax_overlap.all_gather_start, whose gradient's "
        "reduce-scatter is then a future too"),
    "all-gather": (
        "they are the gradients of jax.lax.psum_scatter calls: use "
        "jax_overlap.psum_scatter_start there"),
    "all-to-all": (
        "they are the gradients of jax.lax.all_to_all calls: use "
        "jax_overlap.all_to_all_start there"),
    "collective-permute": (
        "they are the gradients of jax.lax.ppermute calls: use "
        "jax_overlap.ppermute_start there"),
}


def render_summary(report, top: int = TOP) -> str:
  """The summary of `report` as text."""
  lines = [f"Overlap report: {report.source}"]
  lines += _totals(report)
  shown = _most_exposed(report, top)
  if shown:
    n = len(report.collectives)
    lines.append("")
    lines.append(f"Most exposed ({len(shown)} of {n} collective"
                 f"{'s' if n != 1 else ''}; the whole table: --full, or "
                 "report.table()):")
    for rank, (i, c) in enumerate(shown, 1):
      lines += collective_lines(rank, i, c)
  lines += hint_lines(report)
  if report.notes:
    lines.append("")
    lines += [f"Note: {n}" for n in report.notes]
  return "\n".join(lines) + "\n"


def hint_lines(report) -> list[str]:
  """'What to change:' and its hints, after a blank line (none: [])."""
  hints = hints_for(report)
  if not hints:
    return []
  return ["", "What to change:"] + [f"  - {h}" for h in hints]


def _totals(report) -> list[str]:
  t = report.totals
  comm, exposed, bound = t["comm_s"], t["exposed_s"], t["bound_exposed_s"]
  share = f" ({exposed / comm:.0%} of it)" if comm > 0 else ""
  lines = [
      f"{len(report.collectives)} collective"
      f"{'' if len(report.collectives) == 1 else 's'} in the {report.schedule} "
      f"schedule; times modelled on {report.hardware.name}, not measured.",
      f"  communication   {format_seconds(comm)}",
      f"  exposed         {format_seconds(exposed)}{share}",
      f"  no schedule can hide {format_seconds(bound)} of it (data "
      "dependencies kept); a better schedule could save "
      f"{format_seconds(max(0.0, exposed - bound), exposed)}",
      f"  compute         {format_seconds(report.compute_s)}; step "
      f"{format_seconds(report.step_s)}",
  ]
  return lines


def _most_exposed(report, top: int):
  ranked = sorted(enumerate(report.collectives, 1),
                  key=lambda ic: (-ic[1].exposed_s, ic[0]))
  return [(i, c) for i, c in ranked[:top] if c.exposed_s > 0]


def collective_lines(rank: int, index: int, c) -> list[str]:
  """Collective `c` (#`index` of the report) as the summary's two lines:
  what it is and what it cost; where it comes from and its flags."""
  runs = f", {c.runs:g} runs" if c.runs != 1 else ""
  head = (f"  {rank}. #{index} {c.kind} {c.start} -> {c.done or '?'}: exposed "
          f"{format_seconds(c.exposed_s)} of {format_seconds(c.comm_s)}"
          f"{runs}, {format_bytes(c.bytes)}")
  where = f"at {short_path(c.where)}" if c.where else "source line unknown"
  leaf = f"leaf {c.leaf}" if c.leaf else "leaf unknown"
  tail = f"     {where}; {leaf}"
  if c.step:
    tail += f"; plan step {c.step}"
  if c.flags:
    tail += "; " + "; ".join(c.flags)
  return [head, tail]


def hints_for(report) -> list[str]:
  """What to change, the largest exposed time first (each a sentence)."""
  found: list[tuple[float, str]] = []
  # pipeline_loss's own sums get their own finding; the rest, the others
  own = [c for c in report.collectives if tick_names.summed(c.leaf)]
  collectives = [c for c in report.collectives if not tick_names.summed(c.leaf)]
  if any(c.exposed_s > 0 for c in own):
    found.append(_pipeline_sums(own))
  t = report.totals
  gap = t["exposed_s"] - t["bound_exposed_s"]
  # When the dependencies force what is exposed, moving starts cannot help.
  forced = t["exposed_s"] > 0 and gap <= 0.05 * t["exposed_s"]
  small = [c for c in collectives if c.bytes < SMALL_BYTES and c.exposed_s > 0]
  if len(small) >= 2:
    leaves = _leaves(small)
    found.append((sum(c.exposed_s for c in small),
                  f"{len(small)} collectives under {format_bytes(SMALL_BYTES)} "
                  f"expose {format_seconds(sum(c.exposed_s for c in small))}, "
                  "nearly all latency: combine these leaves into fewer, "
                  f"larger transfers ({leaves})"))
  # What autodiff wrote has no future to keep, made blocking or not.
  autodiff = [c for c in collectives if not c.is_async and c.exposed_s > 0
              and c.kind in _FUTURE and FROM_AUTODIFF in c.flags]
  blocked = [c for c in collectives if c.made_blocking and c.exposed_s > 0
             and FROM_AUTODIFF not in c.flags]
  if blocked:
    c = blocked[0]
    found.append((sum(b.exposed_s for b in blocked),
                  f"{len(blocked)} collective(s) were made synchronous by the "
                  f"backend (first: {c.start}{_at(c)}): they expose "
                  f"{format_seconds(sum(b.exposed_s for b in blocked))}; "
                  "keep the future but check the backend's async flags, or see "
                  "what the written order would give (overlap_report(fn, "
                  "schedule='written')(*args))"))
  plain = [c for c in collectives if not c.is_async and not c.made_blocking
           and c.exposed_s > 0 and c.kind in _FUTURE
           and FROM_AUTODIFF not in c.flags]
  for kind in sorted({c.kind for c in autodiff}):
    of_kind = [c for c in autodiff if c.kind == kind]
    c = max(of_kind, key=lambda p: p.exposed_s)
    found.append((sum(p.exposed_s for p in of_kind),
                  f"{len(of_kind)} blocking {kind}(s) that autodiff inserted "
                  f"expose {format_seconds(sum(p.exposed_s for p in of_kind))}"
                  f" (largest: {c.start}{_at(c)}): "
                  + _AUTODIFF_CHANGE[kind]))
  if plain:
    c = max(plain, key=lambda p: p.exposed_s)
    found.append((sum(p.exposed_s for p in plain),
                  f"{len(plain)} blocking collective(s) expose "
                  f"{format_seconds(sum(p.exposed_s for p in plain))} (largest:"
                  f" {c.start}{_at(c)}): use jax_overlap.{_FUTURE[c.kind]} and "
                  "call .done() where the value is first needed"))
  if not forced:
    found += [_exposed_end("first", c, "start it during the compute before "
                           "it (the embedding, or the previous step's update)")
              for c in _first_exposed(report) if c in collectives]
    found += [_exposed_end("last", c, "finish it later, during compute that "
                           "does not need it (the optimizer update of other "
                           "leaves)") for c in _last_exposed(report)
              if c in collectives]
  queued = [c for c in collectives
            if c.queued_behind and c.exposed_s > c.comm_s * 1.001]
  if queued and not forced:
    c = max(queued, key=lambda q: q.exposed_s - q.comm_s)
    wait = sum(q.exposed_s - q.comm_s for q in queued)
    found.append((wait,
                  f"{len(queued)} collective(s) wait {format_seconds(wait)} "
                  "beyond their own transfers for another on the same link "
                  f"(largest: {c.start} queued behind "
                  f"{', '.join(c.queued_behind)} on the {c.link} link): "
                  "start them earlier, or what they wait for later"))
  unknown = [c for c in collectives if any(f.startswith("trip count unknown")
                                           for f in c.flags)]
  if unknown:
    found.append((0.0, f"{len(unknown)} collective(s) are in loops whose trip "
                  "count was not found: they were modelled as running once"))
  found.sort(key=lambda h: -h[0])
  hints = [h for _, h in found[:5]]
  if forced:
    hints.insert(0, "what is exposed is what the data dependencies force: no "
                 "schedule of this program hides more than "
                 f"{format_seconds(max(gap, 0.0), t['exposed_s'])}; hiding "
                 "more needs independent work beside the transfers, or fewer "
                 "or larger ones")
  return hints


def _pipeline_sums(own):
  """The finding for `pipeline_loss`'s own sums over its pipeline axis
  (patterns/pipeline/tick_names.py): what they are, and that they are
  needed. Not "shard those inputs over the axis": `pipeline_loss` refuses
  xs and targets sharded over it (tests/patterns/pipeline/pipeline_sum_hint_test.py)."""
  exposed = [c for c in own if c.exposed_s > 0]
  c = max(exposed, key=lambda p: p.exposed_s)
  what = {w for p in exposed for w in tick_names.summed(p.leaf)}
  grads = sorted(w[len("the gradient of "):] for w in what
                 if w.startswith("the gradient of "))
  parts = (["the loss"] if "the loss" in what else []) + (
      [f"the gradient{'s' if len(grads) > 1 else ''} of " + _listed(grads)]
      if grads else [])
  return (sum(p.exposed_s for p in exposed),
          f"{len(exposed)} collective(s) that pipeline_loss writes expose "
          f"{format_seconds(sum(p.exposed_s for p in exposed))} (largest: "
          f"{c.start}{_at(c)}): over the devices of its pipeline axis, each "
          f"holding its stages' part, they sum {' and '.join(parts)}. "
          "pipeline_loss refuses xs and targets sharded over that axis, "
          "so these sums are needed, once a step, after the schedule: nothing "
          "to change (a gradient not asked for, such as xs's outside "
          "jax.grad's argnums, is left out of the compiled program; the "
          "written schedule still shows its sum)")


def _listed(words) -> str:
  """'a', 'a and b', 'a, b and c'."""
  return ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1]


def _exposed_end(which: str, c, advice: str):
  """A finding for the `which` ("first" or "last") collective of its
  computation, which overlaps nothing."""
  return (c.exposed_s,
          f"the {which} {c.kind} of {c.computation} ({c.start}{_at(c)}) "
          f"overlaps nothing and exposes {format_seconds(c.exposed_s)}: "
          + advice)


def _first_exposed(report):
  """Per computation, its first async collective when it overlaps nothing
  and exposes something (the first gather of a pass)."""
  seen, out = set(), []
  for c in report.collectives:
    if c.computation in seen:
      continue
    seen.add(c.computation)
    if c.is_async and not c.overlapped and c.exposed_s > 0:
      out.append(c)
  return out


def _last_exposed(report):
  """Per computation, its last async collective when it overlaps nothing,
  exposes something and is not also its first."""
  last = {}
  for c in report.collectives:
    last[c.computation] = c
  firsts = {id(c) for c in _first_exposed(report)}
  return [c for c in last.values() if c.is_async and not c.overlapped
          and c.exposed_s > 0 and id(c) not in firsts]


def _at(c) -> str:
  return f" at {short_path(c.where)}" if c.where else ""


def short_path(where: str) -> str:
  """`file:line`, the file relative to the working directory when under it
  (the record keeps it whole)."""
  path, sep, line = where.rpartition(":")
  if not sep or not os.path.isabs(path):
    return where
  try:
    rel = os.path.relpath(path)
  except ValueError:   # another drive
    return where
  return where if rel.startswith("..") else f"{rel}:{line}"


def _leaves(records, most: int = 4) -> str:
  names = []
  for c in records:
    name = c.leaf or c.start
    if name not in names:
      names.append(name)
  more = f", +{len(names) - most} more" if len(names) > most else ""
  return ", ".join(names[:most]) + more
