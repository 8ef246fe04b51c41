"""The errors a user can meet when reading a schedule or a hardware profile."""

from __future__ import annotations


class HloParseError(ValueError):
  """Scheduled HLO that cannot be read: says which line and why.

  Attributes:
    source: where the text came from (a path, or '<text>').
    line_number: 1-based line in that text (0 when no line applies).
    line: the text of that line, stripped ('' when no line applies).
    reason: what is wrong, and what to do about it.

  Example:
    >>> from jax_overlap import HloParseError, OverlapReport
    >>> try:
    ...   OverlapReport.from_hlo("HloModule m, is_scheduled=true\\nENTRY %e {\\n")
    ... except HloParseError as e:
    ...   print(e.line_number)
    2
  """

  def __init__(self, reason: str, line_number: int = 0, line: str = "",
               source: str = "<text>"):
    self.reason = reason
    self.line_number = line_number
    self.line = line.strip()
    self.source = source
    super().__init__(self._message())

  def _message(self) -> str:
    where = f"{self.source}:{self.line_number}" if self.line_number \
        else self.source
    text = self.line if len(self.line) <= 120 else self.line[:117] + "..."
    return f"{where}: {self.reason}" + (f": {text}" if text else "")


class HardwareProfileError(ValueError):
  """A hardware profile name that is unknown, or a profile file that is wrong.

  Example:
    >>> from jax_overlap import HardwareProfile, HardwareProfileError
    >>> try:
    ...   HardwareProfile.named("tpu-v9")
    ... except HardwareProfileError as e:
    ...   print(str(e).split(";")[0])
    unknown hardware 'tpu-v9'
  """
