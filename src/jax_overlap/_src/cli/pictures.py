"""`--timeline PNG` and `--trace JSON`, written the same way by every command
that has a report to draw (`inspect`, `profile`)."""

from __future__ import annotations

import sys

BAD_INPUT = 2


def write_pictures(report, args, command: str) -> int:
  """Writes what `args.timeline` / `args.trace` ask for; the exit status:
  0, BAD_INPUT where a file cannot be written, 1 without matplotlib."""
  try:
    if args.timeline:
      report.save_timeline(args.timeline)
      print(f"wrote {args.timeline}", file=sys.stderr)
    if args.trace:
      report.save_trace(args.trace)
      print(f"wrote {args.trace}", file=sys.stderr)
  except OSError as e:
    print(f"jax-overlap {command}: error: cannot write {e.filename}: {e.strerror}",
          file=sys.stderr)
    return BAD_INPUT
  except ImportError as e:
    print(f"jax-overlap {command}: {e}", file=sys.stderr)
    return 1
  return 0
