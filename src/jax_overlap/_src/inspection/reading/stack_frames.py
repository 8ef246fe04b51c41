"""Source lines from a dump's stack-frame tables.

The supported jax versions write no `source_file`/`source_line` in an
instruction's metadata; they write `stack_frame_id=N`, and the module's text
opens with four tables that resolve it:

    FileNames
    1 "/home/me/train.py"
    FunctionNames
    1 "loss"
    FileLocations
    1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=9 end_column=9}
    StackFrames
    1 {file_location_id=1 parent_frame_id=1}

A frame's parent is the frame of its caller (a frame that is its own parent,
or whose parent is 0, is outermost). The line a report names is the innermost
frame outside jax and this library: the user's code that started the
collective, also when a pattern (`fsdp_scan`) started it on the user's behalf.

Example:
  >>> frames = StackFrames.from_tables({
  ...     "FileNames": {1: '"/site-packages/jax_overlap/_src/x.py"', 2: '"train.py"'},
  ...     "FunctionNames": {1: '"f"'},
  ...     "FileLocations": {1: "{file_name_id=1 function_name_id=1 line=7}",
  ...                       2: "{file_name_id=2 function_name_id=1 line=42}"},
  ...     "StackFrames": {1: "{file_location_id=2 parent_frame_id=1}",
  ...                     2: "{file_location_id=1 parent_frame_id=1}"}})
  >>> frames.location(2)
  'train.py:42'
"""

from __future__ import annotations

import dataclasses
import re

from jax_overlap._src.inspection.reading import lexing

TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Frames in these files are jax's or ours, not the user's.
_LIBRARY = re.compile(r"(^|/)(jax|jaxlib|jax_overlap)/")
_FIELD = re.compile(r"(\w+)=(-?\d+)")


@dataclasses.dataclass
class StackFrames:
  """frame id -> (file, line, parent frame id)."""

  frames: dict[int, tuple[str, int, int]]

  @classmethod
  def from_tables(cls, tables: dict[str, dict[int, str]]) -> StackFrames:
    """The tables as read: table name -> row id -> the rest of the row."""
    files = {}
    for k, text in tables.get("FileNames", {}).items():
      try:
        files[k] = lexing.unquote(text.strip())
      except ValueError:
        files[k] = text.strip().strip('"')
    locations = {}
    for k, text in tables.get("FileLocations", {}).items():
      fields = dict((n, int(v)) for n, v in _FIELD.findall(text))
      locations[k] = (files.get(fields.get("file_name_id", 0), "?"),
                      fields.get("line", 0))
    frames = {}
    for k, text in tables.get("StackFrames", {}).items():
      fields = dict((n, int(v)) for n, v in _FIELD.findall(text))
      file, line = locations.get(fields.get("file_location_id", 0), ("?", 0))
      frames[k] = (file, line, fields.get("parent_frame_id", 0))
    return cls(frames)

  def location(self, frame_id: int) -> str | None:
    """`file:line` of the innermost frame outside jax and this library
    (the innermost frame if every one is inside), None for an unknown id."""
    chain, seen, k = [], set(), frame_id
    while k in self.frames and k not in seen:
      seen.add(k)
      file, line, parent = self.frames[k]
      chain.append((file, line))
      k = parent
    if not chain:
      return None
    for file, line in chain:
      if not _LIBRARY.search(file):
        return f"{file}:{line}"
    return f"{chain[0][0]}:{chain[0][1]}"
