"""Probes: a feature that only a lowering or a compile can reveal, found
once per process, outside the user's context.

The version differences of `_compat.py` that no attribute reveals are
answered by probes run here (`probe_once`). Pinned by
tests/integration/fresh_process_test.py (the same answer in every user
context; a probe that raised is tried again).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

# A feature that only a lowering or a compile can reveal is probed once per
# process. The probe runs when the user's first program needs the answer:
# inside their trace, their `jax.set_mesh` / sharding / default-device
# context, perhaps in one process of several. jax keeps all of those per
# thread (and in contextvars, which a new thread does not inherit), so a
# probe runs on a thread of its own, where jax sees its global defaults only:
# its answer does not depend on the user's context, nor does it disturb it.
# Only an answer is kept: a probe that raised is tried again next time.
_probe_answers: dict[str, Any] = {}
_probe_lock = threading.Lock()


def run_outside_user_context(fn: Callable[[], Any]) -> Any:
  """`fn()`, run on a fresh thread: no enclosing trace, mesh or sharding
  context applies to it. Returns its value or raises its exception."""
  outcome: dict[str, Any] = {}

  def target():
    try:
      outcome["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      outcome["error"] = e
  thread = threading.Thread(target=target, name="jax_overlap-probe",
                            daemon=True)
  thread.start()
  thread.join()
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


def probe_once(name: str, fn: Callable[[], Any]) -> Any:
  """`fn()`'s answer, found once per process outside the user's context."""
  if name not in _probe_answers:
    answer = run_outside_user_context(fn)
    with _probe_lock:
      _probe_answers.setdefault(name, answer)
  return _probe_answers[name]
