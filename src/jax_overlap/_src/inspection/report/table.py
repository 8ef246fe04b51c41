"""The report as a readable table: `rich` when installed, plain text otherwise."""

from __future__ import annotations

import io


#: Modelled times closer than this (relative, or absolute in seconds) are the
#: same to the model: its inputs are flops and bytes, its sums carry float
#: noise, and three significant digits is what it can tell.
RELATIVE_RESOLUTION = 1e-3
ABSOLUTE_RESOLUTION_S = 1e-9


def same_time(a: float, b: float) -> bool:
  """Whether the model can tell `a` from `b` (seconds)."""
  return abs(a - b) <= max(ABSOLUTE_RESOLUTION_S,
                           RELATIVE_RESOLUTION * max(abs(a), abs(b)))


def format_seconds(seconds: float, scale: float | None = None) -> str:
  """Seconds in s/ms/us, 3 significant digits; "0" for what the model cannot
  tell from 0 (below 1 ns, or below its resolution of `scale`)."""
  if same_time(seconds, 0.0) or (
      scale is not None and abs(seconds) <= RELATIVE_RESOLUTION * abs(scale)):
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
  """Up to `most` names, one a line (the plain renderer joins lines)."""
  if not names:
    return "-"
  more = [f"+{len(names) - most} more"] if len(names) > most else []
  return "\n".join(names[:most] + more)


def _kind(record) -> str:
  """The kind, and under it the leaf a pattern's collective moves."""
  return record.kind + (f"\n{record.leaf}" if record.leaf else "")


def _origin(record) -> str:
  """The user's source line and the leaf it moves, each or 'unknown', and the
  plan step it is in flight across where a pattern's plan names one."""
  return (f"{record.where or 'source unknown'}\n"
          f"{('leaf ' + record.leaf) if record.leaf else 'leaf unknown'}"
          + (f"\nplan step {record.step}" if record.step else ""))


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
    rows.append([str(i), c.kind, _origin(c), f"{c.start}\n-> {c.done or '?'}",
                 where,
                 format_bytes(c.bytes), overlapped, format_seconds(c.comm_s),
                 format_seconds(c.exposed_s), _runs(c.runs),
                 "\n".join(c.flags)])
  header = ["#", "kind", "source, leaf", "start -> done", "computation",
            "bytes", "overlapped", "comm", "exposed", "runs", "flags"]
  if len({r[4] for r in rows}) <= 1 and len({c.computation for c in
                                             report.copies} | {r[4] for r in
                                                               rows}) <= 1:
    header.pop(4)
    rows = [r[:4] + r[5:] for r in rows]
  out.append((f"Collectives in the {report.schedule} schedule (times "
              f"modelled on {hw}, not measured)", header, rows))
  if report.copies:
    rows = [[str(i), f"{c.start}\n-> {c.done or '?'}", c.computation,
             format_bytes(c.bytes), _names(c.overlapped),
             format_seconds(c.copy_s), format_seconds(c.exposed_s),
             _runs(c.runs), "\n".join(c.flags)]
            for i, c in enumerate(report.copies, 1)]
    out.append((f"Async copies (modelled on {hw})",
                ["#", "start -> done", "computation", "bytes", "overlapped",
                 "copy", "exposed", "runs", "flags"], rows))
  if report.written:
    rows = [[str(i), _kind(w), w.where or "-", format_bytes(w.bytes),
             _names(w.overlapped), format_seconds(w.comm_s),
             format_seconds(w.compute_s), format_seconds(w.exposed_s),
             "\n".join(w.flags)]
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
      f"Totals of the {report.schedule} schedule, modelled on "
      f"{report.hardware.name} (not measured):",
      f"  communication      {format_seconds(t['comm_s'])}",
      f"  exposed            {format_seconds(t['exposed_s'])}",
      f"  perfect schedule   {format_seconds(t['bound_exposed_s'])} exposed,"
      " data dependencies kept (would save "
      f"{format_seconds(max(saved, 0.0), t['exposed_s'])}; all on one link "
      f"and dependencies ignored: {format_seconds(t['serial_link_bound_s'])})",
      f"  compute            {format_seconds(report.compute_s)};"
      f" step {format_seconds(report.step_s)}",
  ]
  lines += [f"Note: {n}" for n in report.notes]
  return lines


#: Past this many rows rich is slow to lay out; plain text is used instead.
RICH_ROWS = 200


def render(report, use_rich: bool | None = None, width: int = 140) -> str:
  """The report as text; `use_rich=None` uses rich when it is installed and
  the report has at most `RICH_ROWS` collectives."""
  if use_rich is None and len(report.collectives) > RICH_ROWS:
    use_rich = False
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


_WRAPS = {"started at", "written between start and done"}
_NUMERIC = {"#", "bytes", "comm", "exposed", "runs", "copy", "compute",
            "exposed if kept"}


def _render_rich(head, parts, lines, width) -> str:
  from rich import box  # noqa: PLC0415
  from rich.console import Console  # noqa: PLC0415
  from rich.table import Table  # noqa: PLC0415
  from rich.text import Text  # noqa: PLC0415
  tables, needed = [], width
  for title, header, rows in parts:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD,
                  show_lines=True, pad_edge=False)
    total = 0
    for k, name in enumerate(header):
      numeric = name in _NUMERIC
      # Names are never folded: a column is as wide as its longest line.
      longest = max([len(line) for row in rows for line in row[k].split("\n")]
                    + [len(name) if numeric else 1])
      wraps = name in _WRAPS
      table.add_column(name, justify="right" if numeric else "left",
                       no_wrap=numeric, overflow="fold",
                       min_width=None if wraps else longest)
      total += (min(longest, 28) if wraps else longest) + 3
    for row in rows:
      table.add_row(*(Text(v) for v in row))
    tables.append(table)
    needed = max(needed, total)
  # Wider than asked rather than dropping a column.
  buffer = io.StringIO()
  console = Console(file=buffer, width=needed, color_system=None,
                    force_terminal=False, highlight=False)
  console.print(head, markup=False)
  for table in tables:
    console.print(table)
  for line in lines:
    console.print(line, markup=False)
  return "\n".join(line.rstrip() for line in
                   buffer.getvalue().rstrip().split("\n")) + "\n"


def _render_plain(head, parts, lines) -> str:
  out = [head]
  for title, header, rows in parts:
    out += ["", title]
    rows = [[v.replace("\n-> ", " -> ").replace("\n", ", ") for v in row]
            for row in rows]
    widths = [max(len(str(r[k])) for r in [header] + rows)
              for k in range(len(header))]
    for row in [header] + rows:
      out.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths))
                 .rstrip())
  out.append("")
  out += lines
  return "\n".join(out) + "\n"
