"""The protobuf wire format, just enough to walk a message's fields.

`ProfileData` does not expose the metadata plane's event metadata, where the
profile keeps each module's `Hlo Proto`; this reads it without a protobuf
dependency. A malformed message raises `ValueError`.

Example:
  >>> [(f, v) for f, _, v in fields(bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x68, 0x69]))]
  [(1, 150), (2, b'hi')]
"""

from __future__ import annotations

from typing import Iterator

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if i >= len(data):
      raise ValueError("truncated varint")
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i
    if shift > 70:
      raise ValueError("varint too long")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
  """(field number, wire type, value) for each field of a message: an int for
  varints, bytes otherwise."""
  i, n = 0, len(data)
  while i < n:
    key, i = _varint(data, i)
    number, wire_type = key >> 3, key & 7
    if wire_type == VARINT:
      value, i = _varint(data, i)
    elif wire_type in (FIXED64, FIXED32):
      size = 8 if wire_type == FIXED64 else 4
      value, i = data[i:i + size], i + size
    elif wire_type == LENGTH:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    else:
      raise ValueError(f"unsupported wire type {wire_type}")
    if i > n:
      raise ValueError("truncated field")
    yield number, wire_type, value


def messages(data: bytes, number: int) -> Iterator[bytes]:
  """The length-delimited fields numbered `number`."""
  for n, wire_type, value in fields(data):
    if n == number and wire_type == LENGTH:
      yield value


def first(data: bytes, number: int, default=None):
  """The first field numbered `number`, or `default`."""
  for n, _, value in fields(data):
    if n == number:
      return value
  return default
