"""Scanning HLO text: comments, quoted strings and nested brackets.

Everything here knows that `"..."` strings (with backslash escapes) may hold
any bracket, comma or `//`, and that `'...'` quotes names in mesh syntax.
"""

from __future__ import annotations

import re

_OPEN = {"(": ")", "{": "}", "[": "]"}
_CLOSE = {v: k for k, v in _OPEN.items()}


_COMMENT_OR_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*|/\*.*?(?:\*/|\Z)',
                                re.S)


def strip_comments(text: str) -> str:
  """`text` without `// ...` and `/* ... */` comments; newlines are kept, so
  line numbers do not move."""
  def keep_strings(m):
    found = m.group(0)
    return found if found.startswith('"') else "\n" * found.count("\n")
  return _COMMENT_OR_STRING.sub(keep_strings, text)


_STRUCTURE = re.compile(
    r'"(?:[^"\\]|\\.)*(")?' + r"|'(?:[^'\\]|\\.)*(')?" + r"|[()\[\]{},]", re.S)


def _structure(text: str, start: int = 0) -> tuple[list[tuple[int, str]], bool]:
  """(position and character of each bracket and comma outside quoted strings,
  from `start` on; whether a string is left open at the end)."""
  marks, open_string = [], False
  for m in _STRUCTURE.finditer(text, start):
    found = m.group(0)
    if found[0] == '"' or found[0] == "'":
      open_string = open_string or (m.group(1) is None and m.group(2) is None)
    else:
      marks.append((m.start(), found))
  return marks, open_string


def depth_change(text: str) -> tuple[int, bool]:
  """(opened minus closed brackets in `text`, whether a string is left open)."""
  if '"' not in text and "'" not in text:  # the common case, fast
    return (sum(text.count(c) for c in _OPEN)
            - sum(text.count(c) for c in _CLOSE)), False
  marks, open_string = _structure(text)
  depth = sum(1 if c in _OPEN else -1 for _, c in marks if c != ",")
  return depth, open_string


def split_top_level(text: str) -> list[str]:
  """Splits at commas outside strings and brackets; pieces are stripped, and
  empty pieces dropped. Raises ValueError on unbalanced brackets."""
  marks, open_string = _structure(text)
  pieces, begin, stack = [], 0, []
  for i, c in marks:
    if c == "," and not stack:
      pieces.append(text[begin:i])
      begin = i + 1
    elif c != ",":
      _push_or_pop(stack, c)
  if stack or open_string:
    raise ValueError("unclosed " + (repr(stack[-1]) if stack else "string"))
  pieces.append(text[begin:])
  return [p.strip() for p in pieces if p.strip()]


def matching_close(text: str, pos: int) -> int:
  """Index of the bracket that closes the one at `text[pos]`."""
  stack: list[str] = []
  for i, c in _structure(text, pos)[0]:
    if c == ",":
      continue
    _push_or_pop(stack, c)
    if not stack:
      return i
  raise ValueError(f"unclosed {text[pos]!r}")


def _push_or_pop(stack: list[str], c: str) -> None:
  if c in _OPEN:
    stack.append(_OPEN[c])
  elif not stack or stack.pop() != c:
    raise ValueError(f"unbalanced {c!r}")


def unquote(text: str) -> str:
  """The value of a double-quoted HLO string (C escapes, octal included)."""
  text = text.strip()
  if len(text) < 2 or text[0] != '"' or text[-1] != '"':
    raise ValueError(f"expected a quoted string, got {text[:30]!r}")
  body = text[1:-1]
  out = bytearray()
  i = 0
  simple = {"n": b"\n", "t": b"\t", "r": b"\r", '"': b'"', "\\": b"\\",
            "'": b"'", "?": b"?", "a": b"\a", "b": b"\b", "f": b"\f",
            "v": b"\v"}
  while i < len(body):
    c = body[i]
    if c != "\\" or i + 1 >= len(body):
      out += c.encode()
      i += 1
      continue
    nxt = body[i + 1]
    if nxt in simple:
      out += simple[nxt]
      i += 2
    elif nxt in "01234567":
      j = i + 1
      while j < len(body) and j < i + 4 and body[j] in "01234567":
        j += 1
      out.append(int(body[i + 1:j], 8) & 0xFF)
      i = j
    elif nxt == "x":
      j = i + 2
      while j < len(body) and body[j] in "0123456789abcdefABCDEF":
        j += 1
      out.append(int(body[i + 2:j] or "0", 16) & 0xFF)
      i = j
    else:
      out += nxt.encode()
      i += 2
  return out.decode("utf-8", errors="replace")
