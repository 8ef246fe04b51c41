"""Prints the lines under src/ that read as measurement history.

A module's docstring states its invariant, one line of why, and the test
that pins it; what was measured, on which compiler build, when and how fast
belongs in docs/ or in a commit message (issue 28). This lists each line of
src/ (Python and the design-note Markdown) that still cites one: a libtpu or
CUDA-plugin build, "measured with/on/here", an "N of M" count, a date, a
timing, a load average or a test-run count. Version facts the code depends
on are allowed where they belong: compiler builds in `_src/quirks.py`'s
table, jax versions in `_src/_compat.py` and `_src/quirks.py`.

Usage: python tools/history_lines.py [ROOT]   (ROOT: the repository's src/)
Prints `path:line: text` per line, then the count; exits 1 if any.
"""

from __future__ import annotations

import pathlib
import re
import sys

#: What reads as history anywhere in src/.
HISTORY = re.compile(
    r"libtpu \d"                                  # a compiler build named
    r"|(?:cuda12-|CUDA |the CUDA )plugin \d"
    r"|(?<!was )\b[Mm]easured (?:with|on|here|in|at)\b"   # measuring, not
    r"|\((?:[a-z ]+, )?measured[,:]|; measured\b"  # a tested range's name
    r"|\b\d+ of \d+\b"                            # counts from one run
    r"|\bmid-20\d\d|\b20\d\d-\d\d-\d\d"           # dates
    r"|\b\d+(?:\.\d+)?(?:-\d+)? ?(?:ms|us|µs) (?:a|per|each)\b"   # timings
    r"|load average|\b\d+ passed\b|\bx faster\b|\d ?× faster")
#: Version numbers, allowed only in the files that hold version facts.
VERSIONS = re.compile(r"\bjax \d+\.\d+\.\d+|\blibtpu \d|\bplugin \d")
VERSION_FILES = {"_compat.py", "quirks.py"}
_REPO = pathlib.Path(__file__).resolve().parent.parent


def offending(root: pathlib.Path):
  """(path, line number, text) of each history line under `root`."""
  for path in sorted(root.rglob("*")):
    if path.suffix not in (".py", ".md") or ".egg-info" in str(path):
      continue
    lines = path.read_text(encoding="utf-8").splitlines()
    versions_allowed = path.name in VERSION_FILES
    for number, line in enumerate(lines, 1):
      text = line.strip()
      if versions_allowed:
        found = HISTORY.search(VERSIONS.sub("", text))
      else:
        found = HISTORY.search(text) or VERSIONS.search(text)
      if found:
        yield path, number, text


def main(argv: list[str]) -> int:
  root = pathlib.Path(argv[1]).resolve() if len(argv) > 1 else _REPO / "src"
  found = list(offending(root))
  for path, number, text in found:
    shown = path.relative_to(_REPO) if path.is_relative_to(_REPO) else path
    print(f"{shown}:{number}: {text}")
  print(f"{len(found)} history line(s) under {root}")
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
