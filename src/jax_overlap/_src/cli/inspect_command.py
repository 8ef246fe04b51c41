"""Report what each collective of a scheduled HLO dump overlapped.

  jax-overlap inspect FILE [--hardware NAME|FILE] [--full | --json]
                           [--timeline out.png] [--trace out.json]
  jax-overlap inspect --diff A B [--hardware NAME|FILE] [--json]

FILE is a scheduled HLO text dump: *after_optimizations.txt from
XLA_FLAGS=--xla_dump_to=DIR, or compiled.as_text(). All times are modelled on
the hardware profile (default: tpu-v5e for a TPU dump, h100 otherwise), not
measured. The default output is a
summary (totals, the collectives that expose the most, what to change);
--full prints every collective. Exit status: 0 on
success, 2 for bad input (unreadable file, malformed HLO, unknown hardware).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from jax_overlap._src.cli.pictures import BAD_INPUT, write_pictures
from jax_overlap._src.inspection.report.diff import diff_reports
from jax_overlap._src.inspection.errors import (
    HardwareProfileError, HloParseError)
from jax_overlap._src.inspection.model.hardware import HardwareProfile
from jax_overlap._src.inspection.report.overlap_report import OverlapReport
from jax_overlap._src.inspection.report import summary
from jax_overlap._src.inspection.report.table import render

NAME = "inspect"
HELP = "what each collective in an HLO dump overlapped (modelled times)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.formatter_class = argparse.RawDescriptionHelpFormatter
  parser.add_argument("file", nargs="?", metavar="FILE",
                      help="scheduled HLO text (*after_optimizations.txt)")
  parser.add_argument("--diff", nargs=2, metavar=("A", "B"),
                      help="show what changed from dump A to dump B")
  parser.add_argument(
      "--hardware", metavar="NAME|FILE", default=None,
      help="a built-in profile (" + ", ".join(HardwareProfile.builtin_names())
      + ") or a .toml/.json profile file; default tpu-v5e for a TPU dump "
      "(tiled layouts), else h100")
  parser.add_argument("--json", action="store_true",
                      help="print the report as JSON")
  parser.add_argument("--full", action="store_true",
                      help="print every collective, copy and window as a "
                      "table (default: the summary)")
  parser.add_argument("--timeline", metavar="OUT.png",
                      help="draw the modelled timeline as a PNG")
  parser.add_argument("--trace", metavar="OUT.json",
                      help="write the modelled timeline for ui.perfetto.dev")


def run(args: argparse.Namespace) -> int:
  if args.diff and args.file:
    return _fail("give FILE or --diff A B, not both")
  if not args.diff and not args.file:
    return _fail("give a FILE to inspect, or --diff A B")
  if args.diff and (args.timeline or args.trace):
    return _fail("--timeline and --trace draw one report; drop --diff")
  try:
    if args.diff:
      a = OverlapReport.from_hlo(args.diff[0], hardware=args.hardware)
      # Both on one profile (with none named, the one A's platform chose).
      b = OverlapReport.from_hlo(args.diff[1],
                                 hardware=args.hardware or a.hardware)
      diff = diff_reports(a, b)
      if args.json:
        print(json.dumps(diff.to_dict(), indent=2))
      else:
        print(diff, end="")
      return 0
    report = OverlapReport.from_hlo(args.file, hardware=args.hardware)
  except (HloParseError, HardwareProfileError) as e:
    return _fail(str(e))
  if args.json:
    print(report.to_json())
  elif args.full:
    # A pipe is not a terminal: plain text, no cell ever cut.
    width = max(100, shutil.get_terminal_size((140, 24)).columns)
    print(render(report, width=width,
                 use_rich=None if sys.stdout.isatty() else False), end="")
    hints = summary.hint_lines(report)
    if hints:
      print("\n".join(hints))
  else:
    print(report, end="")
  return write_pictures(report, args, "inspect")


def _fail(message: str) -> int:
  print(f"jax-overlap inspect: error: {message}", file=sys.stderr)
  return BAD_INPUT
