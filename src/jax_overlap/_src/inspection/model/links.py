"""Which link (queue) carries each transfer in the model.

Hardware runs some transfers side by side: a bidirectional ring sends both
ways at once (NVLink and ICI are full duplex), collectives on different
streams or execution threads do not wait for each other, and async copies
have their own engine. The model gives each of these its own queue; what
shares a queue runs one at a time, in issue order, so a transfer that waits
for another is said to be *queued behind* it.

The queues:

* `copy` for async copies;
* a point-to-point transfer (collective-permute, send, recv) by its kind and
  direction, read from `source_target_pairs`: every pair moving `+k` devices
  (mod the device count) is direction `+k`, `-k` past the half; a mix of
  directions is `mixed`;
* every other collective on the `collectives` queue;
* each of these per execution thread, and per GPU `operation_queue_id`
  other than 0 (a separate stream).

Example:
  >>> from jax_overlap._src.inspection.model.links import direction
  >>> direction([(0, 1), (1, 2), (2, 3), (3, 0)], 4), direction([(1, 0), (0, 3)], 4)
  ('+1', '-1')
"""

from __future__ import annotations

from jax_overlap._src.inspection.reading import attributes as attrs
from jax_overlap._src.inspection.reading.hlo_module import MAIN_THREAD

POINT_TO_POINT = frozenset({"collective-permute", "send", "recv"})
COPY_LINK = "copy"


def direction(pairs: list[tuple[int, int]], devices: int) -> str:
  """'+k' or '-k' when every (source, target) moves k devices one way round a
  ring of `devices`, else 'mixed' ('?' with no pairs)."""
  if not pairs:
    return "?"
  n = max(devices, max(max(p) for p in pairs) + 1)
  offsets = {(t - s) % n for s, t in pairs if s != t}
  if len(offsets) != 1:
    return "mixed" if offsets else "self"
  k = offsets.pop()
  return f"+{k}" if k <= n // 2 else f"-{n - k}"


def link_of(pair, module) -> str:
  """The queue `pair` (a `schedule.pairing.Pair`) is modelled on."""
  if pair.role == "copy":
    name = COPY_LINK
  elif pair.kind in POINT_TO_POINT:
    pairs = _source_target_pairs(pair.start, module)
    name = f"{pair.kind} {direction(pairs, module.num_devices)}"
  else:
    name = "collectives"
  queue = attrs.backend_config(pair.start).get("operation_queue_id")
  if queue not in (None, "0", 0, ""):
    name += f" [stream {queue}]"
  if pair.thread != MAIN_THREAD:
    name += f" [{pair.thread}]"
  return name


def _source_target_pairs(instr, module) -> list[tuple[int, int]]:
  """Those of `instr`, else of the permute an async wrapper or fusion holds."""
  found = attrs.source_target_pairs(instr)
  todo = list(instr.callees("calls", "to_apply"))
  while not found and todo:
    comp = module.computations.get(todo.pop())
    if comp is None:
      continue
    for inner in comp.instructions:
      found = found or attrs.source_target_pairs(inner)
      todo += inner.callees("calls", "to_apply")
  return found
