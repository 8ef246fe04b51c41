"""The report as a readable table: `rich` when installed, plain text otherwise."""

from __future__ import annotations

import io


def format_seconds(seconds: float) -> str:
  if seconds == 0:
    return "0"
  if seconds < 1e-3:
    return f"{seconds * 1e6:.3g} us"
  if seconds < 1:
    return f"{seconds * 1e3:.3g} ms"
  return f"{seconds:.3g} s"


def format_bytes(nbytes: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= size:
      return f"{nbytes / size:.3g} {unit}"
  return f"{nbytes:g} B"


def _names(names: list[str], most: int = 3) -> str:
  if not names:
    return "-"
  shown = ", ".join(names[:most])
  more = f", +{len(names) - most}" if len(names) > most else ""
  return f"{len(names)}: {shown}{more}"


def _runs(runs: float) -> str:
  return f"{runs:g}"


def sections(report) -> list[tuple[str, list[str], list[list[str]]]]:
  """(title, header, rows) for each table of the report."""
  hw = report.hardware.name
  several = len(report.threads) > 1
  out = []
  rows = []
  for i, c in enumerate(report.collectives, 1):
    where = c.computation + (f" [{c.thread}]" if several else "")
    overlapped = "- (blocking)" if not c.is_async else _names(c.overlapped)
    rows.append([str(i), c.kind, f"{c.start} -> {c.done or '?'}", where,
                 format_bytes(c.bytes), overlapped, format_seconds(c.comm_s),
                 format_seconds(c.exposed_s), _runs(c.runs),
                 "; ".join(c.flags)])
  out.append((f"Collectives (times modelled on {hw}, not measured)",
              ["#", "kind", "start -> done", "computation", "bytes",
               "overlapped", "comm", "exposed", "runs", "flags"], rows))
  if report.copies:
    rows = [[str(i), f"{c.start} -> {c.done or '?'}", c.computation,
             format_bytes(c.bytes), _names(c.overlapped),
             format_seconds(c.copy_s), format_seconds(c.exposed_s),
             _runs(c.runs), "; ".join(c.flags)]
            for i, c in enumerate(report.copies, 1)]
    out.append((f"Async copies (modelled on {hw})",
                ["#", "start -> done", "computation", "bytes", "overlapped",
                 "copy", "exposed", "runs", "flags"], rows))
  if report.written:
    rows = [[str(i), w.kind, w.where, format_bytes(w.bytes),
             _names(w.overlapped), format_seconds(w.comm_s),
             format_seconds(w.compute_s), format_seconds(w.exposed_s),
             "; ".join(w.flags)]
            for i, w in enumerate(report.written, 1)]
    out.append(("Written windows (from the traced program, not compiled; "
                f"modelled on {hw})",
                ["#", "kind", "started at", "bytes",
                 "written between start and done", "comm", "compute",
                 "exposed if kept", "flags"], rows))
  return out


def summary(report) -> list[str]:
  t = report.totals
  saved = t["exposed_s"] - t["bound_exposed_s"]
  lines = [
      f"Totals, modelled on {report.hardware.name} (not measured):",
      f"  communication      {format_seconds(t['comm_s'])}",
      f"  exposed            {format_seconds(t['exposed_s'])}",
      f"  perfect schedule   {format_seconds(t['bound_exposed_s'])} exposed"
      f" (would save {format_seconds(max(saved, 0.0))})",
      f"  compute            {format_seconds(report.compute_s)};"
      f" step {format_seconds(report.step_s)}",
  ]
  lines += [f"Note: {n}" for n in report.notes]
  return lines


def render(report, use_rich: bool | None = None, width: int = 140) -> str:
  """The report as text; `use_rich=None` uses rich when it is installed."""
  if use_rich is None:
    try:
      import rich  # noqa: F401, PLC0415
      use_rich = True
    except ImportError:
      use_rich = False
  head = f"Overlap report: {report.source}"
  parts = sections(report)
  if use_rich:
    return _render_rich(head, parts, summary(report), width)
  return _render_plain(head, parts, summary(report))


def _render_rich(head, parts, lines, width) -> str:
  from rich.console import Console  # noqa: PLC0415
  from rich.table import Table  # noqa: PLC0415
  buffer = io.StringIO()
  console = Console(file=buffer, width=width, color_system=None,
                    force_terminal=False, highlight=False)
  console.print(head, markup=False)
  for title, header, rows in parts:
    table = Table(title=title, title_justify="left", show_lines=False)
    for name in header:
      table.add_column(name, overflow="fold")
    for row in rows:
      table.add_row(*row)
    console.print(table)
  for line in lines:
    console.print(line, markup=False)
  return buffer.getvalue().rstrip() + "\n"


def _render_plain(head, parts, lines) -> str:
  out = [head]
  for title, header, rows in parts:
    out += ["", title]
    widths = [max(len(str(r[k])) for r in [header] + rows)
              for k in range(len(header))]
    for row in [header] + rows:
      out.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths))
                 .rstrip())
  out.append("")
  out += lines
  return "\n".join(out) + "\n"
