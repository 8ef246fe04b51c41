"""Reading scheduled HLO text (`*after_optimizations.txt`, `compiled.as_text()`).

The text is read line by line into computations of instructions. An
instruction may span several lines: it goes on while a bracket or string is
open, after a line ending in ',', before a line starting with ',', and while
it has not reached its opcode and the next line starts no instruction. `//`
and `/* */` comments are dropped first; the source-location tables newer XLA
prints after the header are skipped. Every failure is an `HloParseError`
naming the line.

Dump files and `compile().as_text()` of the same compile differ: where
`as_text()` writes `%e = f32[8] get-tuple-element(%t), index=1` and uses
`%e`, a dump file (`--xla_dump_to`, jax 0.11 and later) writes no such
instruction and uses `%t#1`. The reader gives both one form: each `%t#N` is
read as a `get-tuple-element` of `%t` (named `t#N`), placed right after `%t`.
"""

from __future__ import annotations

import os
import pathlib
import re

from jax_overlap._src.inspection.reading import lexing
from jax_overlap._src.inspection.errors import HloParseError
from jax_overlap._src.inspection.reading.hlo_module import (
    MAIN_THREAD, HloComputation, HloInstruction, HloModule)
from jax_overlap._src.inspection.reading.shapes import parse_shape
from jax_overlap._src.inspection.reading.stack_frames import StackFrames
from jax_overlap._src.inspection.reading.async_sugar import expand_async_sugar
from jax_overlap._src.inspection.reading.trip_counts import annotate_trip_counts

_HEADER = re.compile(r"HloModule\s+%?([^\s,]+)")
_COMPUTATION = re.compile(r"(ENTRY\s+)?%?([^\s({}]+)\s*(\(.*\)\s*->\s*.*)?\{$")
_INSTRUCTION = re.compile(r"(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_STARTS_INSTRUCTION = re.compile(
    r"(ROOT\s+)?%?[\w.\-]+\s*=\s*(\(|[a-z][a-z0-9]*\[)")
_OPCODE = re.compile(r"[a-z][a-z0-9\-_]*")
_TYPED = re.compile(r"\(|[a-z][a-z0-9]*\[")
_NAME = re.compile(r"%?([\w.\-]+(?:#\d+)*)")
# `%t#1` (element 1 of the tuple `%t`), as dump files write it; `%t#1#0` nests.
_TUPLE_ELEMENT = re.compile(r"(.+)#(\d+)")
_LOCATION_TABLES = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}
_LOCATION_ROW = re.compile(r"\d+\s")
_NO_OPERANDS = {"parameter", "constant", "iota"}
# Attributes without which the schedule cannot be followed.
_REQUIRED = {"while": ("body", "condition"), "fusion": ("calls",),
             "call": ("to_apply",), "async-start": ("calls",),
             "call-start": ("to_apply",), "get-tuple-element": ("index",)}


def load_hlo(text_or_path: str | os.PathLike) -> HloModule:
  """A module from HLO text, or from the path of a file holding it.

  A `str` is text when it has a newline or starts with 'HloModule', and a path
  otherwise.
  """
  if isinstance(text_or_path, os.PathLike) or (
      isinstance(text_or_path, str) and "\n" not in text_or_path
      and not text_or_path.lstrip().startswith("HloModule")):
    path = pathlib.Path(text_or_path)
    try:
      text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
      raise HloParseError(
          f"cannot read this file ({e.strerror or e}); pass the path of an "
          "HLO text dump such as *after_optimizations.txt",
          source=str(path)) from None
    return parse_hlo_text(text, source=str(path))
  if not isinstance(text_or_path, str):
    raise TypeError("from_hlo: text_or_path must be HLO text or a path, got "
                    f"{type(text_or_path).__name__}")
  return parse_hlo_text(text_or_path)


def parse_hlo_text(text: str, source: str = "<text>") -> HloModule:
  """The module in `text`. Raises `HloParseError` naming the line."""
  raw = text.split("\n")
  return _Reader(raw, lexing.strip_comments(text).split("\n"), source).module()


def parse_instruction(text: str, line_number: int = 0,
                      source: str = "<text>") -> HloInstruction:
  """One instruction from its (joined) text:
  `[ROOT] name = shape opcode(operands), key=value, ...`."""
  def fail(reason):
    return HloParseError(reason, line_number, text, source)

  m = _INSTRUCTION.match(text)
  if not m:
    raise fail("expected an instruction 'name = shape opcode(operands)'")
  try:
    shape, pos = parse_shape(text, m.end())
  except ValueError as e:
    raise fail(f"cannot read the shape ({e})") from None
  shape_text = text[m.end():pos].strip()
  while pos < len(text) and text[pos].isspace():
    pos += 1
  op = _OPCODE.match(text, pos)
  if not op or op.end() >= len(text) or text[op.end()] != "(":
    raise fail("expected 'opcode(' after the shape")
  try:
    close = lexing.matching_close(text, op.end())
  except ValueError as e:
    raise fail(f"the operand list is not closed ({e})") from None
  opcode = op.group(0)
  inner = text[op.end() + 1:close]
  attributes = _attributes(text[close + 1:], fail)
  operands = () if opcode in _NO_OPERANDS else _operands(inner, fail)
  return HloInstruction(
      name=m.group(2), opcode=opcode, shape=shape, operands=operands,
      attributes=attributes, is_root=bool(m.group(1)),
      line_number=line_number, text=text, shape_text=shape_text,
      operand_text=inner.strip())


def _has_opcode(text: str) -> bool:
  """Whether `text` gets as far as `name = shape opcode(`."""
  m = _INSTRUCTION.match(text)
  if not m:
    return True  # not an instruction at all: let the parser say so
  try:
    _, pos = parse_shape(text, m.end())
  except ValueError:
    return False
  return bool(re.compile(r"\s*[a-z][a-z0-9\-_]*\(").match(text, pos))


def _attributes(rest: str, fail) -> dict[str, str]:
  rest = rest.strip()
  if not rest:
    return {}
  if not rest.startswith(","):
    raise fail(f"unexpected {rest[:20]!r} after the operands")
  try:
    pieces = lexing.split_top_level(rest[1:])
  except ValueError as e:
    raise fail(f"cannot split the attributes ({e})") from None
  out = {}
  for piece in pieces:
    key, eq, value = piece.partition("=")
    if not eq or not re.fullmatch(r"[\w.\-]+", key.strip()):
      raise fail(f"cannot read the attribute {piece[:40]!r} (expected key=value)")
    out[key.strip()] = value.strip()
  return out


def _operands(inner: str, fail) -> tuple[str, ...]:
  try:
    pieces = lexing.split_top_level(inner)
  except ValueError as e:
    raise fail(f"cannot split the operands ({e})") from None
  names = []
  for piece in pieces:
    typed, _, last = piece.rpartition(" ")
    m = _NAME.fullmatch(last.strip())
    if not m:
      raise fail(f"cannot read the operand {piece[:40]!r}")
    if typed.strip() and not _TYPED.match(typed.strip()):
      raise fail(f"cannot read the operand {piece[:40]!r}")
    names.append(m.group(1))
  return tuple(names)


class _Reader:
  """One pass over the lines; `raw` for messages, `lines` without comments."""

  def __init__(self, raw: list[str], lines: list[str], source: str):
    self.raw, self.lines, self.source = raw, lines, source
    self.i = 0

  def fail(self, reason: str, line_number: int) -> HloParseError:
    text = self.raw[line_number - 1] if 0 < line_number <= len(self.raw) else ""
    return HloParseError(reason, line_number, text, self.source)

  def module(self) -> HloModule:
    name, attributes, header_line = self._header()
    computations: dict[str, HloComputation] = {}
    in_tables = None
    tables: dict[str, dict[int, str]] = {}
    while self.i < len(self.lines):
      line = self.lines[self.i].strip()
      number = self.i + 1
      if not line:
        self.i += 1
        continue
      if line in _LOCATION_TABLES:
        in_tables = line
        tables.setdefault(line, {})
        self.i += 1
        continue
      if in_tables and _LOCATION_ROW.match(line):
        row, _, rest = line.partition(" ")
        tables[in_tables][int(row)] = rest
        self.i += 1
        continue
      in_tables = None
      if line.startswith("HloModule"):
        raise self.fail("a second HloModule: pass one module per file", number)
      m = _COMPUTATION.match(line)
      if not m:
        raise self.fail("expected a computation ('%name (...) -> shape {') "
                        "or the end of the text", number)
      comp = self._computation(m.group(2), bool(m.group(1)), number)
      if comp.name in computations:
        raise self.fail(f"computation %{comp.name} is defined twice", number)
      computations[comp.name] = comp
    module = HloModule(name, attributes, computations, self.source)
    if tables:
      module.stack_frames = StackFrames.from_tables(tables)
    self._check(module, header_line)
    expand_async_sugar(module)
    annotate_trip_counts(module)
    return module

  def _header(self) -> tuple[str, dict[str, str], int]:
    while self.i < len(self.lines) and not self.lines[self.i].strip():
      self.i += 1
    if self.i >= len(self.lines):
      raise HloParseError("the text is empty; expected an HLO module",
                          source=self.source)
    number = self.i + 1
    text = self.lines[self.i].strip()
    m = _HEADER.match(text)
    if not m:
      raise self.fail("expected 'HloModule <name>, ...' first; is this an HLO "
                      "text dump?", number)
    self.i += 1
    depth, _ = lexing.depth_change(text)
    while depth > 0 and self.i < len(self.lines):
      more = self.lines[self.i].strip()
      text += " " + more
      depth += lexing.depth_change(more)[0]
      self.i += 1
    attributes = _attributes(text[m.end():], lambda r: self.fail(r, number))
    return m.group(1), attributes, number

  def _computation(self, name: str, is_entry: bool,
                   header_line: int) -> HloComputation:
    self.i += 1
    instructions: list[HloInstruction] = []
    thread = MAIN_THREAD
    chunk: list[str] = []
    chunk_line = 0
    depth = 0
    while True:
      if self.i >= len(self.lines):
        if chunk:
          raise self.fail("this instruction is not finished when the text "
                          "ends (truncated?)", chunk_line)
        last = max((k + 1 for k, l in enumerate(self.lines) if l.strip()),
                   default=0)
        raise self.fail(f"computation %{name} is not closed when the text "
                        f"ends at line {last} (truncated?)", header_line)
      line = self.lines[self.i].strip()
      if not chunk:
        if not line:
          self.i += 1
          continue
        if line.startswith("}"):
          thread = self._trailer(line, self.i + 1) or thread
          self.i += 1
          break
        chunk_line = self.i + 1
      elif depth > 0 and _STARTS_INSTRUCTION.match(line):
        raise self.fail("a bracket opened in this instruction is never "
                        "closed", chunk_line)
      chunk.append(line)
      change, open_string = lexing.depth_change(line)
      depth += change
      self.i += 1
      if depth < 0:
        raise self.fail("a bracket is closed that was never opened",
                        chunk_line)
      if depth > 0 or open_string or line.endswith(",") or \
          self._next_line_continues(" ".join(chunk)):
        continue
      text = " ".join(chunk)
      instructions.append(parse_instruction(text, chunk_line, self.source))
      instructions[-1].text = text
      chunk, depth = [], 0
    instructions = self._with_tuple_elements(instructions)
    comp = HloComputation(name, instructions, is_entry, thread, header_line)
    self._check_operands(comp)
    return comp

  def _with_tuple_elements(
      self, instructions: list[HloInstruction]) -> list[HloInstruction]:
    """`instructions` with a `get-tuple-element` named `t#N` after `%t` for
    every `%t#N` operand (the dump file's form of what `as_text()` writes as
    an instruction), so the rest of the reader sees one form."""
    wanted = {o for i in instructions for o in i.operands if "#" in o}
    if not wanted:
      return instructions
    by_name = {i.name: i for i in instructions}
    after: dict[str, list[HloInstruction]] = {}
    made: dict[str, HloInstruction] = {}

    def element(name: str, user: HloInstruction) -> HloInstruction | None:
      if name in made or name in by_name:
        return made.get(name) or by_name[name]
      m = _TUPLE_ELEMENT.fullmatch(name)
      if not m:
        return None  # an undefined operand: _check_operands says so
      tuple_ = element(m.group(1), user)
      if tuple_ is None:
        return None
      index = int(m.group(2))
      if not tuple_.shape.is_tuple or index >= len(tuple_.shape.elements):
        raise self.fail(
            f"operand %{name}: %{tuple_.name} has no element {index} (its "
            f"shape is {tuple_.shape_text or tuple_.shape})", user.line_number)
      shape = tuple_.shape.elements[index]
      gte = HloInstruction(
          name=name, opcode="get-tuple-element", shape=shape,
          operands=(tuple_.name,), attributes={"index": str(index)},
          line_number=user.line_number, shape_text=str(shape),
          text=f"%{name} = {shape} get-tuple-element(%{tuple_.name}), "
               f"index={index}", operand_text=f"%{tuple_.name}")
      made[name] = gte
      after.setdefault(tuple_.name, []).append(gte)
      return gte

    for instr in instructions:
      for operand in instr.operands:
        if "#" in operand:
          element(operand, instr)
    out: list[HloInstruction] = []

    def place(instr: HloInstruction) -> None:
      out.append(instr)
      for gte in after.get(instr.name, ()):
        place(gte)  # a nested element right after its own tuple element

    for instr in instructions:
      place(instr)
    return out

  def _next_line_continues(self, text: str) -> bool:
    """Whether the next line goes on with `text`: it starts with ',', or
    `text` stops before its opcode and the next line starts no instruction."""
    j = self.i
    while j < len(self.lines) and not self.lines[j].strip():
      j += 1
    if j >= len(self.lines):
      return False
    following = self.lines[j].strip()
    if following.startswith(","):
      return True
    if following.startswith("}") or _STARTS_INSTRUCTION.match(following):
      return False
    return not _has_opcode(text)

  def _trailer(self, line: str, number: int) -> str | None:
    rest = line[1:].strip()
    if not rest:
      return None
    attributes = _attributes(rest, lambda r: self.fail(r, number))
    thread = attributes.get("execution_thread")
    try:
      return lexing.unquote(thread) if thread else None
    except ValueError:
      raise self.fail("cannot read execution_thread", number) from None

  def _check_operands(self, comp: HloComputation) -> None:
    if not comp.instructions:
      raise self.fail(f"computation %{comp.name} has no instructions",
                      comp.line_number)
    seen = set()
    for instr in comp.instructions:
      if instr.name in seen:
        raise self.fail(f"%{instr.name} is defined twice in %{comp.name}",
                        instr.line_number)
      seen.add(instr.name)
    for instr in comp.instructions:
      for operand in instr.operands:
        if operand not in comp.by_name:
          raise self.fail(f"operand %{operand} is not defined in computation "
                          f"%{comp.name}", instr.line_number)

  def _check(self, module: HloModule, header_line: int) -> None:
    entries = [c for c in module.computations.values() if c.is_entry]
    if len(entries) != 1:
      what = "no ENTRY computation (truncated?)" if not entries else \
          "more than one ENTRY computation"
      raise self.fail(what, len(self.lines) if not entries
                      else entries[1].line_number)
    if not module.is_scheduled:
      raise self.fail(
          "this module is not scheduled (no is_scheduled=true on its HloModule "
          "line); pass the *after_optimizations.txt dump or "
          "compiled.as_text()", header_line)
    for comp, instr in module.instructions():
      for key in _REQUIRED.get(instr.opcode, ()):
        if key not in instr.attributes:
          raise self.fail(f"{instr.opcode} without {key}=", instr.line_number)
      for callee in instr.callees():
        if callee not in module.computations:
          raise self.fail(f"calls %{callee}, which is not in the module",
                          instr.line_number)
