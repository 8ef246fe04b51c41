"""HLO shapes as text: `f32[8,128]{1,0:T(8,128)S(1)}`, tuples, tokens; their bytes."""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element. Sub-byte types count fractionally: `bytes` is logical.
_ELEMENT_BYTES = {
    "pred": 1, "s1": 1 / 8, "u1": 1 / 8, "s2": 1 / 4, "u2": 1 / 4,
    "s4": 1 / 2, "u4": 1 / 2, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
    "f64": 8, "c64": 8, "c128": 16, "token": 0, "opaque": 0,
}
_FLOAT8_OR_SMALLER = re.compile(r"f(8|6|4)e\d+m\d+\w*")

_DTYPE = re.compile(r"[a-z][a-z0-9]*")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def element_bytes(dtype: str) -> float:
  """Bytes of one element of `dtype` (0 for tokens)."""
  if dtype in _ELEMENT_BYTES:
    return _ELEMENT_BYTES[dtype]
  m = _FLOAT8_OR_SMALLER.fullmatch(dtype)
  if m:
    return int(m.group(1)) / 8
  raise ValueError(f"unknown element type {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Shape:
  """An array shape (`dtype` and `dims`) or a tuple of shapes (`elements`).

  `dims` holds bounds for dynamic dimensions (`f32[<=8]` has dims (8,)).
  `memory_space` is the `S(n)` of the layout, None when there is none;
  `tiled` whether the layout has tiles (`T(8,128)`: XLA:TPU's).
  """

  dtype: str | None = None
  dims: tuple[int, ...] = ()
  elements: tuple[Shape, ...] | None = None
  memory_space: int | None = None
  tiled: bool = False

  @property
  def is_tuple(self) -> bool:
    return self.elements is not None

  @property
  def is_token(self) -> bool:
    return self.dtype == "token"

  def leaves(self) -> list[Shape]:
    if self.elements is None:
      return [self]
    return [leaf for e in self.elements for leaf in e.leaves()]

  @property
  def bytes(self) -> float:
    """Logical bytes of every array in the shape (tokens count 0)."""
    return sum(element_bytes(s.dtype) * math.prod(s.dims)
               for s in self.leaves())

  def __str__(self) -> str:
    if self.elements is not None:
      return "(" + ", ".join(str(e) for e in self.elements) + ")"
    return f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"


def parse_shape(text: str, pos: int = 0) -> tuple[Shape, int]:
  """Reads one shape starting at `text[pos]`; returns it and the end position.

  Raises ValueError (with what was expected) when there is no shape there.
  """
  pos = _skip_space(text, pos)
  if pos < len(text) and text[pos] == "(":
    return _parse_tuple(text, pos)
  m = _DTYPE.match(text, pos)
  if not m or m.end() >= len(text) or text[m.end()] != "[":
    raise ValueError(f"expected a shape at {text[pos:pos + 30]!r}")
  dtype = m.group(0)
  element_bytes(dtype)  # raises on an unknown type
  close = text.find("]", m.end())
  if close < 0:
    raise ValueError(f"unclosed '[' in shape {text[pos:pos + 30]!r}")
  dims = tuple(_dim(d) for d in text[m.end() + 1:close].split(",") if d.strip())
  pos = close + 1
  memory_space, tiled = None, False
  if pos < len(text) and text[pos] == "{":
    end = _matching(text, pos, "{", "}")
    layout = text[pos + 1:end].partition(":")[2]
    ms = _MEMORY_SPACE.search(layout)
    memory_space = int(ms.group(1)) if ms else None
    tiled = "T(" in layout
    pos = end + 1
  return Shape(dtype=dtype, dims=dims, memory_space=memory_space,
               tiled=tiled), pos


def shape_from_text(text: str) -> Shape:
  """The shape that is the whole of `text`."""
  shape, end = parse_shape(text)
  if text[end:].strip():
    raise ValueError(f"unexpected {text[end:].strip()[:30]!r} after a shape")
  return shape


def _parse_tuple(text: str, pos: int) -> tuple[Shape, int]:
  elements = []
  pos = _skip_space(text, pos + 1)
  if pos < len(text) and text[pos] == ")":
    return Shape(elements=()), pos + 1
  while True:
    element, pos = parse_shape(text, pos)
    elements.append(element)
    pos = _skip_space(text, pos)
    if pos >= len(text):
      raise ValueError("unclosed '(' in a tuple shape")
    if text[pos] == ")":
      return Shape(elements=tuple(elements)), pos + 1
    if text[pos] != ",":
      raise ValueError(f"expected ',' or ')' in a tuple shape at "
                       f"{text[pos:pos + 30]!r}")
    pos += 1


def _dim(text: str) -> int:
  text = text.strip().lstrip("<=")
  if text == "?":
    return 1
  return int(text)


def _skip_space(text: str, pos: int) -> int:
  while pos < len(text) and text[pos].isspace():
    pos += 1
  return pos


def _matching(text: str, pos: int, open_: str, close: str) -> int:
  depth = 0
  for i in range(pos, len(text)):
    if text[i] == open_:
      depth += 1
    elif text[i] == close:
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f"unclosed {open_!r} in {text[pos:pos + 30]!r}")
