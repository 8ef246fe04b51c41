"""The rows of an `OverlapReport`: `CollectiveRecord`, `CopyRecord`,
`WrittenRecord`.

`to_dict` gives them under the field names of the docs
(`docs/overlap-report.md`). All times are modelled, never measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any



class _Record:
  """A row of the report; `to_dict` gives its fields as plain data."""

  def to_dict(self) -> dict[str, Any]:
    return _plain(dataclasses.asdict(self))


@dataclasses.dataclass
class CollectiveRecord(_Record):
  """One collective, start to done. `is_async` is `async` in `to_dict`.
  `cost_source` is None unless the compute in its window was costed from
  another source than the report's (`OverlapReport.cost_source`) says."""

  kind: str
  start: str
  done: str | None
  computation: str
  where: str | None
  leaf: str | None
  step: str | None
  thread: str
  link: str
  queued_behind: list[str]
  is_async: bool
  made_blocking: bool
  bytes: float
  bytes_in_flight: float
  group_size: int | None
  overlapped: list[str]
  spans_iteration: bool
  trip_count: int | None
  loop: str | None
  runs: float
  comm_s: float
  exposed_s: float
  flags: list[str]
  cost_source: str | None = None

  def to_dict(self) -> dict[str, Any]:
    out = super().to_dict()
    out["async"] = out.pop("is_async")
    return {k: out[k] for k in _COLLECTIVE_FIELDS}


@dataclasses.dataclass
class CopyRecord(_Record):
  """One async copy (`copy-start` to `copy-done`)."""

  start: str
  done: str | None
  computation: str
  thread: str
  bytes: float
  overlapped: list[str]
  spans_iteration: bool
  trip_count: int | None
  loop: str | None
  runs: float
  copy_s: float
  exposed_s: float
  flags: list[str]


@dataclasses.dataclass
class WrittenRecord(_Record):
  """One future as the traced program wrote it (not as compiled): the
  compute written between start and done, and what it would expose if the
  compiler kept that window (`exposed_s`)."""

  collective: str
  kind: str
  where: str | None
  leaf: str | None
  step: str | None
  bytes: float
  group_size: int | None
  overlapped: list[str]
  loop: str | None
  comm_s: float
  compute_s: float
  exposed_s: float
  flags: list[str]


_COLLECTIVE_FIELDS = (
    "kind", "start", "done", "computation", "where", "leaf", "step", "thread",
    "link",
    "queued_behind", "async",
    "made_blocking", "bytes", "bytes_in_flight", "group_size", "overlapped",
    "spans_iteration",
    "trip_count", "loop", "runs", "comm_s", "exposed_s", "flags",
    "cost_source")


def _plain(value):
  """Numbers that are whole become ints, so JSON reads naturally."""
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
    return int(value)
  return value
