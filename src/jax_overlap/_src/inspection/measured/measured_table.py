"""The measured report as text: a row per collective (devices together),
measured beside modelled, then a line per device."""

from __future__ import annotations

from collections import defaultdict

from jax_overlap._src.inspection.report.summary import short_path
from jax_overlap._src.inspection.report.table import format_seconds

HEAD = ("collective", "kind", "source, leaf", "devices", "runs", "measured", "hidden",
        "exposed", "waiting", "modelled comm", "modelled exposed", "flags")


def rows(report) -> list[list[str]]:
  """One row per (module, collective): per-device means of the times."""
  groups = defaultdict(list)
  for r in report.measured:
    groups[(r.module, r.name)].append(r)
  out = []
  for (_, name), rs in groups.items():
    n = len(rs)
    mean = lambda f: sum(getattr(r, f) for r in rs) / n  # noqa: E731
    runs = sorted({r.runs for r in rs})
    model = rs[0].modelled
    flags = []
    for r in rs:
      flags += [short(f) for f in r.flags if short(f) not in flags]
    steps = max(runs) / model["runs"] if model and model["runs"] else 1
    out.append([
        name, rs[0].kind, _source(rs[0]), str(n), "/".join(map(str, runs)),
        format_seconds(mean("measured_s")), format_seconds(mean("hidden_s")),
        format_seconds(mean("exposed_s")), format_seconds(mean("waiting_s")),
        format_seconds(model["comm_s"] * steps) if model else "-",
        format_seconds(model["exposed_s"] * steps) if model else "-",
        "; ".join(flags)])
  return out


def _source(r) -> str:
  """'file:line leaf X', as `inspect`'s rows name the same collective."""
  if not r.where and not r.leaf:
    return "-"
  where = short_path(r.where) if r.where else "source line unknown"
  return f"{where} leaf {r.leaf}" if r.leaf else f"{where} leaf unknown"


_EXPLAINED = {"waits for peers": (
    "waits for peers: part of `measured` passed before the last device started "
    "the same run (the `waiting` column; per device in --json)")}


def short(flag: str) -> str:
  """A flag's label: what stands before its explanation."""
  if "waiting for peers" in flag:
    return "waits for peers"
  return flag.split(":")[0].split(" (")[0]


def render(report) -> str:
  lines = [f"measured overlap of {report.source} ({report.backend}, "
           f"{len(report.totals)} devices"
           + (f", {report.steps} steps" if report.steps else "") + ")"]
  models = sorted({r.hardware.name for r in report.modelled.values()})
  lines.append("times: per-device means, all runs together; modelled "
               + (f"on {', '.join(models)} for the same runs" if models
                  else "times: none (no HLO read)"))
  body = rows(report)
  if body:
    widths = [max(len(h), *(len(row[k]) for row in body))
              for k, h in enumerate(HEAD)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(HEAD, widths)).rstrip())
    for row in body:
      lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
  for device, t in report.totals.items():
    frac = t["overlap_fraction"]
    lines.append(
        f"device {device}: comm {format_seconds(t['comm_s'])}, hidden "
        f"{format_seconds(t['hidden_s'])}, exposed "
        f"{format_seconds(t['exposed_s'])}, overlap "
        + ("-" if frac is None else f"{100 * frac:.0f}%")
        + f", compute {format_seconds(t['compute_s'])}")
  explained = {}
  for r in report.measured:
    for f in r.flags:
      explained.setdefault(short(f), _EXPLAINED.get(short(f), f))
  lines += [f"flag: {f}" for f in explained.values()]
  lines += [f"note: {n}" for n in report.notes]
  return "\n".join(lines) + "\n"
