"""Each schedule's order of actions on each device, as the literature gives it.

The order is all a schedule is; `placing.py` places the actions on ticks by
their dependencies (ZB-V's is chosen as it is placed: placing.py). `send_ticks` (ticks a stage-to-stage send is in flight)
lengthens the warm-ups so that the steady state does not stall: in 1F1B a
microbatch's round trip from stage d back to stage d is then
`2 (p-1-d) (1+send_ticks) + 1` ticks. Pinned by pipeline_schedule_test.py.
"""

from __future__ import annotations

from collections import deque

from jax_overlap._src.patterns.pipeline.actions import B, F, I, W, Action, Pair

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")


def check_arguments(schedule: str, p: int, m: int, v: int) -> None:
  """Raises ValueError naming the argument for an unsupported (p, m, v)."""
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}.")
  for name, val in (("stages", p), ("microbatches", m), ("virtual_stages", v)):
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
      raise ValueError(f"{name}={val!r}: expected a positive int.")
  if p < 2:
    raise ValueError(f"stages={p}: a pipeline needs at least 2 stages (devices "
                     "along the axis); with one, call the stages in a loop.")
  if schedule == "interleaved":
    if v < 2:
      raise ValueError("schedule='interleaved' needs virtual_stages >= 2 (got "
                       f"{v}); with one chunk a device it is '1f1b'.")
    if m % p:
      raise ValueError(f"schedule='interleaved' needs microbatches to be a "
                       f"multiple of stages: got microbatches={m}, stages={p}.")
  elif schedule in ("zb-v", "dualpipev"):
    if v != 2:
      raise ValueError(f"schedule={schedule!r} runs two chunks a device on a V "
                       f"(device d holds stages d and 2p-1-d): got "
                       f"virtual_stages={v}; pass virtual_stages=2 (and lay "
                       "the stages out with pipeline_stage_layout(..., "
                       f"schedule={schedule!r})).")
    if schedule == "dualpipev" and m < 2 * p:
      raise ValueError(f"schedule='dualpipev' needs microbatches >= 2 * "
                       f"stages (got microbatches={m}, stages={p}): its "
                       "published order gives device 0 m-2p+1 steady steps "
                       "of F&B cells; use more microbatches or 'zb-v'.")
  elif v != 1:
    raise ValueError(f"schedule={schedule!r} runs one chunk a device: got "
                     f"virtual_stages={v}; use schedule='interleaved'.")
  if schedule != "gpipe" and m < p:
    raise ValueError(f"schedule={schedule!r} needs microbatches >= stages (got "
                     f"microbatches={m}, stages={p}): with fewer, stage 0 "
                     "never reaches the steady state; use 'gpipe' or more "
                     "microbatches.")


def orders(schedule: str, p: int, m: int, v: int,
           send_ticks: int = 0) -> list[list[Action]]:
  """Device d's actions in the order it runs them (zb-h1: its F and I only;
  placing.py places each W)."""
  if schedule == "forward":   # the loss alone (pipeline_loss, undifferentiated)
    return [[Action(F, i, j) for j in range(v) for i in range(m)]
            for _ in range(p)]
  if schedule == "gpipe":
    return [[Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]
            for _ in range(p)]
  if schedule in ("1f1b", "zb-h1"):
    back = I if schedule == "zb-h1" else B
    return [_one_f_one_b(m, min(m, (p - 1 - d) * (1 + send_ticks)), back)
            for d in range(p)]
  if schedule == "dualpipev":
    return [_dualpipe_v(p, m, d) for d in range(p)]
  return [_interleaved(p, m, v, d, send_ticks) for d in range(p)]


def _one_f_one_b(m: int, warmup: int, back: str) -> list[Action]:
  order = [Action(F, i) for i in range(warmup)]
  for i in range(m - warmup):
    order += [Action(F, warmup + i), Action(back, i)]
  return order + [Action(back, i) for i in range(m - warmup, m)]


def _dualpipe_v(p: int, m: int, r: int) -> list:
  """DualPipeV's order on device r of p (DeepSeek's DualPipe cut in half,
  as Sea AI Lab describes it), in its published phases: 2(p-1-r) forwards
  of chunk 0; r+1 pairs of a chunk-0 and a chunk-1 forward; p-1-r
  zero-bubble steps (I and W of chunk 1, a chunk-1 forward); m-2p+r+1
  steady steps of two F&B cells (a chunk-0 forward with a chunk-1 backward,
  a chunk-1 forward with a chunk-0 backward; device p-1's first runs its two
  halves apart); p-1-r steps of a chunk-1 backward and an F&B; r+1 pairs of
  chunk-1 and chunk-0 backwards, the later half split into I and W; p-1-r
  steps of a W and a chunk-0 I; the r+1 W's left. W's run in the order
  their I's did."""
  nxt = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}
  pending: deque = deque()

  def fwd(c):
    nxt[F, c] += 1
    return Action(F, nxt[F, c] - 1, c)

  def back(c, split=False):
    nxt[B, c] += 1
    i = nxt[B, c] - 1
    if split:
      pending.append(Action(W, i, c))
    return Action(I if split else B, i, c)

  order: list = [fwd(0) for _ in range(2 * (p - 1 - r))]
  for _ in range(r + 1):
    order += [fwd(0), fwd(1)]
  for _ in range(p - 1 - r):
    order += [back(1, True), pending.popleft(), fwd(1)]
  for k in range(m - 2 * p + r + 1):
    if k == 0 and r == p - 1:   # the turn's device: not overlapped
      order += [fwd(0), back(1)]
    else:
      order.append(Pair(fwd(0), back(1)))
    order.append(Pair(fwd(1), back(0)))
  for _ in range(p - 1 - r):
    order += [back(1), Pair(fwd(1), back(0))]
  split = False
  for k in range(r + 1):
    if k == (r + 1) // 2 and r % 2 == 1:
      split = True
    order.append(back(1, split))
    if k == (r + 1) // 2 and r % 2 == 0:
      split = True
    order.append(back(0, split))
  for _ in range(p - 1 - r):
    order += [pending.popleft(), back(0, True)]
  order += [pending.popleft() for _ in range(r + 1)]
  assert not pending and all(n == m for n in nxt.values()), (p, m, r, nxt)
  return order


def _interleaved(p: int, m: int, v: int, d: int, send_ticks: int) -> list[Action]:
  """Megatron's order: microbatches in groups of p, each group through every
  chunk in turn; backward chunks in reverse."""
  total = v * m

  def forward(k):
    return Action(F, (k // (p * v)) * p + k % p, (k // p) % v)

  def backward(k):
    return Action(B, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

  # Megatron's warm-up, with the wrap from the last device back to device 0
  # (a group of p microbatches a chunk) lengthened by the sends in flight.
  warmup = min(total, (p - d - 1) * 2 + (v - 1) * p * (1 + send_ticks))
  order = [forward(k) for k in range(warmup)]
  for k in range(total - warmup):
    order += [forward(warmup + k), backward(k)]
  return order + [backward(k) for k in range(total - warmup, total)]
