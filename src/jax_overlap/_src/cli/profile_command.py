"""Measured overlap of a profile, beside the modelled report of the same module.

  jax-overlap profile PATH [--hardware NAME|FILE] [--hlo FILE] [--json]
                           [--timeline out.png] [--trace out.json]

PATH is an .xplane.pb file (or gzipped), or the directory
jax.profiler.trace(DIR) wrote (the newest capture under it is read). Each
collective's measured time, the part compute on the same device hid, and the
exposed rest stand beside the modelled times of the HLO the profile carries,
or of `--hlo FILE` (the module that ran, `compile().as_text()` or a dump; for
a capture whose HLO this jaxlib cannot read). Exit status: 0 on success, 2
for bad input (a missing, empty or malformed profile or HLO, unknown
hardware).
"""

from __future__ import annotations

import argparse
import sys

from jax_overlap._src.cli.pictures import BAD_INPUT, write_pictures
from jax_overlap._src.inspection.errors import HardwareProfileError, HloParseError
from jax_overlap._src.inspection.measured.measured_report import MeasuredReport
from jax_overlap._src.inspection.measured.xplane import ProfileReadError

NAME = "profile"
HELP = "measured overlap of a jax.profiler capture, beside the modelled one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.formatter_class = argparse.RawDescriptionHelpFormatter
  parser.add_argument("path", metavar="PATH",
                      help=".xplane.pb, or a directory jax.profiler.trace wrote")
  parser.add_argument("--hardware", metavar="NAME|FILE", default=None,
                      help="the profile of the modelled side; default h100")
  parser.add_argument("--hlo", metavar="FILE", action="append",
                      help="the compiled module that ran (HLO text), where the "
                      "profile's own cannot be read; may be given once a module")
  parser.add_argument("--json", action="store_true",
                      help="print the report as JSON")
  parser.add_argument("--timeline", metavar="OUT.png",
                      help="draw the measured timeline as a PNG")
  parser.add_argument("--trace", metavar="OUT.json",
                      help="write the measured timeline for ui.perfetto.dev")


def run(args: argparse.Namespace) -> int:
  try:
    report = MeasuredReport.from_profile(args.path, hardware=args.hardware,
                                         hlo=args.hlo)
  except (ProfileReadError, HardwareProfileError, HloParseError) as e:
    return _fail(str(e))
  print(report.to_json() if args.json else str(report), end="\n" if args.json else "")
  return write_pictures(report, args, "profile")


def _fail(message: str) -> int:
  print(f"jax-overlap profile: error: {' '.join(message.split())}", file=sys.stderr)
  return BAD_INPUT
