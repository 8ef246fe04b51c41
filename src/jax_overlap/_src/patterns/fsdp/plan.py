"""`fsdp_scan`'s plan: its settings turned into a list of steps.

Each step names what it computes (`before`, a layer, a layer's backward,
`after`'s backward, `before`'s backward), which layers' gathers are in flight
across that compute, which layer's gradient is reduce-scattered (HSDP: which
one is all-reduced over the replicas), where the layer's weights come from
and whether the step keeps them for the backward pass. One executor
(engine.py) runs any plan; `jax_overlap.fsdp_plan(...)` returns it to read.

The schedule, one step a layer (p = prefetch, k = the layers kept):

* forward: layer 0 is gathered behind `before` (or at once); step 0 starts
  the gathers of layers 1..p, step j >= 1 that of layer j+p. A gathered
  layer waits in a buffer of at most p layers until its step. The last k
  layers save their gathered weights beside their activations.
* backward: `after`'s backward hides the regather of the last layer (when it
  is not kept); the kept layers use the saved weights, the others are
  regathered p steps ahead of their use (those that cannot be, at the first
  step). Step i reduce-scatters layer i+1's gradient (HSDP: and all-reduces
  layer i+2's over the replicas); layer 0's reduce-scatter hides behind
  `before`'s backward (or is waited for at once).

Each gather is in flight across exactly one step's compute (a future cannot
cross a `lax.scan` iteration): a deeper prefetch moves gathers earlier and
holds more gathered layers; it does not give one more compute to hide behind.
The invariants are pinned by tests/patterns/fsdp/fsdp_plan_test.py.
"""

from __future__ import annotations

import itertools
import numbers
from typing import NamedTuple

import numpy as np

from jax_overlap._src.patterns.fsdp import use_order

#: The layer-0 split (use_order.py) is planned only with the default schedule
#: shape, the one measured on the real compilers (tests/aot).
_SPLIT_WHEN = "prefetch=1 and reshard_after_forward True or 1"


class Step(NamedTuple):
  """One step of a pass: `compute` with the listed transfers in flight.

  compute: "before", "layer", "before+layer", "after" (forward);
    "after_back", "layer_back", "layer_back+before_back", "before_back"
    (backward); "" for a step that only moves (a gather or a reduce-scatter
    waited for at once, with nothing to hide behind).
  layer: the layer computed (None for the ends).
  gathers: the layers whose weights are gathered across the compute.
  scatters: the layers whose gradients are reduce-scattered across it.
  reduce: HSDP: the layer whose gradient is all-reduced over the replicas.
  weights: where the layer's weights come from: "gathered" (a buffer of
    gathered layers), "kept" (saved by the forward pass), "" for the ends.
  keeps: the forward step saves its gathered weights for the backward pass.
  buffered: how many gathered layers wait in the buffer as the step starts.
  split: layer 0's weights (forward) or gradients (backward) travel in
    groups by first use (use_order.py), in one step with the end beside it.
  loop: the step runs inside a `lax.scan` with the steps beside it that do
    the same relative to their layer (else it runs on its own).
  again: the last layer's step does what the loop's steps do, so that it
    runs in the loop (one copy of the layer in the compiled program, not
    two): forward, it gathers its own layer again (the copy the backward
    pass keeps, instead of saving the one it used); backward, it
    reduce-scatters a zero gradient (nothing is pending yet). Neither is
    in `gathers` / `scatters`: each moves no layer the schedule needs.
  """
  compute: str
  layer: int | None = None
  gathers: tuple = ()
  scatters: tuple = ()
  reduce: int | None = None
  weights: str = ""
  keeps: bool = False
  buffered: int = 0
  split: bool = False
  loop: bool = False
  again: bool = False

  def says(self) -> str:
    """What the step computes, in words."""
    words = {"before": "before(x)", "after": "after(y)",
             "after_back": "after's backward",
             "before_back": "before's backward",
             "layer": f"layer {self.layer}",
             "layer_back": f"layer {self.layer}'s backward",
             "": "(nothing: waited for at once)"}
    said = ", then ".join(words[c] for c in self.compute.split("+"))
    return said + (" [split by use]" if self.split else "")


class FsdpPlan:
  """The steps `fsdp_scan` runs for one set of settings (`fsdp_plan`).

  n_layers, prefetch, kept: the stack and the two memory knobs as numbers
    (`kept`: how many of the last layers keep their gathered weights).
  futures: the moves are futures (inside `jax.shard_map`), else reshards on
    an explicit-sharding mesh.
  stages: 2 with HSDP's all-reduce over the replicas (futures only), else 1.
  forward, backward: the steps, in the order they run.
  notes: each setting that changed or did not change the steps, and why.
  fence_inputs: each layer step's inputs are fenced before its first
    operation (schedules that hold several gathered layers: without it XLA
    started their gathers steps early, each holding a gathered layer; the
    default schedule is not fenced so: tying a gather's start to the step's
    inputs cost TPU v5e a window in the backward pass, transfer.py).
  """

  def __init__(self, *, n_layers, prefetch, kept, futures, stages, bucket,
               before, after, has_ys, forward, backward, notes, fence_inputs):
    self.n_layers, self.prefetch, self.kept = n_layers, prefetch, kept
    self.futures, self.stages, self.bucket = futures, stages, bucket
    self.before, self.after, self.has_ys = before, after, has_ys
    self.forward, self.backward = tuple(forward), tuple(backward)
    self.notes, self.fence_inputs = tuple(notes), fence_inputs

  @property
  def steps(self) -> tuple:
    return self.forward + self.backward

  def table(self) -> str:
    """The steps as a plain-text table, one row a step."""
    head = ("pass", "#", "computes", "gathers", "reduce-scatters",
            "all-reduces", "weights", "keeps", "loop")
    rows = []
    for name, steps in (("forward", self.forward), ("backward", self.backward)):
      for k, s in enumerate(steps):
        again = s.again and name == "forward"
        rows.append((name, str(k), s.says(),
                     f"{s.layer} again" if again else _layers(s.gathers),
                     "zeros" if s.again and not again else _layers(s.scatters),
                     _layers(() if s.reduce is None else (s.reduce,)),
                     s.weights or "-", "yes" if s.keeps else "-",
                     "yes" if s.loop else "-"))
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(tuple("-" * w for w in widths))]
                     + [line(r) for r in rows])

  def __str__(self) -> str:
    where = ("futures inside jax.shard_map" if self.futures
             else "jax.reshard on an explicit-sharding mesh")
    title = (f"fsdp_scan plan: {self.n_layers} layers, prefetch={self.prefetch}, "
             f"{self.kept} kept for the backward pass, {where}"
             + (", HSDP" if self.stages == 2 else ""))
    return "\n".join([title, self.table(), "notes:"]
                     + [f"  - {n}" for n in self.notes])

  def __repr__(self) -> str:
    return (f"FsdpPlan(n_layers={self.n_layers}, prefetch={self.prefetch}, "
            f"kept={self.kept}, steps={len(self.steps)})")


def _layers(layers) -> str:
  return ", ".join(map(str, layers)) if layers else "-"


# --- the settings, checked and read as numbers --------------------------------


def kept_layers(reshard_after_forward, n_layers: int) -> int:
  """How many of the last layers keep their gathered weights (0 to n):
  True keeps none (every layer regathered, the least memory), False all of
  them, an int k the last k."""
  if reshard_after_forward is True:
    return 0
  if reshard_after_forward is False:
    return n_layers
  value = reshard_after_forward
  if isinstance(value, np.bool_) or not isinstance(value, numbers.Integral) \
      or not 0 <= value <= n_layers:
    raise ValueError(
        f"fsdp_scan(reshard_after_forward=...) must be True (regather every "
        f"layer in the backward pass), False (keep every gathered layer) or "
        f"an int from 0 to the number of layers ({n_layers} here): how many "
        f"of the last layers keep their gathered weights; got {value!r}.")
  return int(value)


def prefetch_depth(prefetch, n_layers: int) -> int:
  """How many layers ahead a gather starts (at least 1; more than the layers
  there are to gather is the same as all of them)."""
  if isinstance(prefetch, (bool, np.bool_)) \
      or not isinstance(prefetch, numbers.Integral) or prefetch < 1:
    raise ValueError(
        f"fsdp_scan(prefetch=...) must be an int >= 1, how many layers ahead "
        f"of its use each weight gather starts (1: the next layer's gather "
        f"runs behind this layer; each more holds one more gathered layer); "
        f"got {prefetch!r}.")
  return max(1, min(int(prefetch), n_layers - 1))


def check_bool(value, name: str) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"fsdp_scan({name}=...) must be True or False, got "
                    f"{value!r}.")


# --- the schedule ---------------------------------------------------------------


def forward_gathers(j: int, n: int, p: int) -> list[int]:
  """The layers whose gathers run during forward step j (layer j)."""
  if j == 0:
    return list(range(1, min(p, n - 1) + 1))
  return [j + p] if j + p <= n - 1 else []


def backward_gathers(i: int, n: int, p: int, kept: int) -> list[int]:
  """The layers whose regathers run during backward step i (layer i's
  backward), in the order they are used. Layers >= n - kept are not
  regathered; layer n-1, when regathered, is gathered before the first
  step."""
  regathered = n - kept
  if i == n - 1:
    return [r for r in range(min(regathered, n - 1) - 1, -1, -1)
            if r + p >= n - 1]
  r = i - p
  return [r] if 0 <= r < regathered else []


def backward_buffered(i: int, n: int, p: int, kept: int) -> int:
  """How many regathered layers wait, gathered, at the start of step i."""
  def gathered_at(r):   # the step whose compute r's regather runs behind
    return n if r == n - 1 else min(r + p, n - 1)
  return sum(1 for r in range(n - kept) if r <= i and gathered_at(r) > i)


def loop_unroll(unroll: int, p: int) -> int:
  """The loops' unroll: `unroll` rounded up to a multiple of the prefetch
  depth `p` (unroll=1 stays 1). Each step shifts the carried buffer of
  gathered layers by one; over a multiple of p steps each buffered layer
  ends the iteration in the slot it started in, else XLA copies every
  buffered layer at each iteration's end
  (tests/patterns/fsdp/fsdp_memory_knobs_test.py)."""
  return unroll if unroll == 1 else -(-unroll // p) * p


def plan(n_layers: int, *, prefetch=1, reshard_after_forward=1,
         futures: bool = True, hsdp: bool = False, bucket: bool = True,
         before: bool = False, after: bool = False, has_ys: bool = False,
         split: bool = True) -> FsdpPlan:
  """The plan for these settings, or a ValueError/TypeError naming the
  setting that cannot be run and why. `split`: whether the layer-0 split
  is wanted (use_order.ENABLED); the plan says where it applies."""
  if isinstance(n_layers, (bool, np.bool_)) \
      or not isinstance(n_layers, numbers.Integral) or n_layers < 1:
    raise ValueError(f"fsdp_plan(n_layers=...) must be an int >= 1 (the "
                     f"layers of the stack), got {n_layers!r}.")
  for value, name in ((futures, "futures"), (hsdp, "hsdp"), (bucket, "bucket"),
                      (before, "before"), (after, "after"), (has_ys, "has_ys"),
                      (split, "split")):
    check_bool(value, name)
  n = int(n_layers)
  kept = kept_layers(reshard_after_forward, n)
  p = prefetch_depth(prefetch, n)
  stages = 2 if hsdp and futures else 1
  default_shape = kept <= 1 and p == 1
  notes = []
  if prefetch != p:
    notes.append(f"prefetch={prefetch} gathers {p} ahead: no more layers "
                 "are left to gather.")
  split_fwd = split and futures and n >= 2 and default_shape
  split_bwd = split_fwd and stages == 1
  if not split:
    notes.append("layer 0's split by use order is off: its weights and its "
                 "gradient each travel as one transfer.")
  elif not futures:
    notes.append("layer 0 is not split by use order: on an explicit-sharding "
                 "mesh XLA's partitioner makes the collectives.")
  elif n < 2:
    notes.append("layer 0 is not split by use order: one layer is the first "
                 "and the last.")
  elif not default_shape:
    notes.append(f"layer 0 is not split by use order: planned with {_SPLIT_WHEN} "
                 "only (the schedule measured on the real compilers).")
  else:
    notes.append("layer 0's gathers" + (
        "" if stages == 2 else " and its gradient's reduce-scatters")
        + " travel in groups by first use, where the traced layer gives two "
        "or more groups; else as one transfer.")
    if stages == 2:
      notes.append("with HSDP layer 0's gradient travels as one "
                   "reduce-scatter, then one all-reduce (not split).")
  if hsdp and not futures:
    notes.append("HSDP on an explicit-sharding mesh: XLA's partitioner makes "
                 "the all-reduce over the replicas (no all-reduce step).")
  elif hsdp:
    notes.append("HSDP: each layer's gradient is reduce-scattered over the "
                 "fsdp axis, then all-reduced over the replicas one step later.")
  if bucket and futures:
    notes.append("bucket: each transfer moves all of a layer's sharded leaves "
                 "of one dtype in one collective.")
  elif not bucket and futures:
    notes.append("bucket=False: one collective per sharded leaf.")
  if has_ys:
    notes.append("has_ys: each layer's y is written into a buffer carried "
                 "beside x; its cotangent flows back through the carry.")
  fence = not default_shape
  # The last layer in the loops (Step.again): the default schedule, inside
  # shard_map, one stage, the last layer kept, and a loop of middle layers
  # for it to join (with two layers it would run alone either way, and its
  # zero reduce-scatter would only cost; tests/aot/tpu_forms_compiled_test.py).
  fold = futures and default_shape and kept == 1 and stages == 1 and n >= 3
  if fold:
    notes.append(f"layer {n - 1} runs in the loops: its forward step gathers "
                 "it again (the copy the backward pass keeps), its backward "
                 "step reduce-scatters a zero gradient (one copy of the layer "
                 "a pass in the compiled program).")
  if fence:
    notes.append("each layer step's inputs are fenced before it starts (this "
                 "schedule holds several gathered layers).")

  if split_fwd:   # before and layer 0 in one step, layer 0's gathers split
    forward = [Step("before+layer" if before else "layer", 0, (0, 1),
                    weights="gathered", keeps=kept == n, buffered=0,
                    split=True)]
  else:
    forward = [Step("before" if before else "", gathers=(0,))]
  for j in range(1 if split_fwd else 0, n):
    forward.append(Step(
        "layer", j, tuple(forward_gathers(j, n, p)), weights="gathered",
        keeps=j >= n - kept, buffered=1 if j == 0 else min(p, n - j),
        again=fold and j == n - 1))
  if after:
    forward.append(Step("after"))

  regathered = n - kept
  first = (n - 1,) if regathered == n else ()
  backward = []
  if after or first:
    backward.append(Step("after_back" if after else "", gathers=first))
  for i in range(n - 1, -1, -1):
    scatters = (i + 1,) if i < n - 1 else ()
    if split_bwd and i == 0:   # layer 0's backward, its reduce-scatters split
      scatters += (0,)         # by use, then before's backward, in one step
    backward.append(Step(
        "layer_back+before_back" if split_bwd and i == 0 and before
        else "layer_back", i, tuple(backward_gathers(i, n, p, kept)),
        scatters=scatters,
        reduce=i + 2 if stages == 2 and i < n - 2 else None,
        weights="kept" if i >= regathered else "gathered",
        buffered=backward_buffered(i, n, p, kept),
        split=split_bwd and i == 0, again=fold and i == n - 1))
  if stages == 2 and n >= 2:
    backward.append(Step("", reduce=1))
  if not split_bwd:
    backward.append(Step("before_back" if before else "", scatters=(0,),
                         reduce=0 if stages == 2 else None))
  forward, backward = _loops(forward, backward, n, fence, stages)
  return FsdpPlan(n_layers=n, prefetch=p, kept=kept, futures=futures,
                  stages=stages, bucket=bucket, before=before, after=after,
                  has_ys=has_ys, forward=forward, backward=backward,
                  notes=notes, fence_inputs=fence)


def forward_signature(step) -> tuple:
  """What a forward layer step does relative to its layer."""
  return (tuple(g - step.layer for g in step.gathers), step.buffered,
          step.keeps)


def backward_signature(step, run_of) -> tuple:
  """What a backward layer step does relative to its layer; `run_of(i)`:
  the forward run that saved layer i."""
  return (tuple(g - step.layer for g in step.gathers), step.buffered,
          step.weights, (step.layer + 1 in step.scatters) + (
              step.reduce is not None), run_of(step.layer))


def runs(steps, signature) -> list[list]:
  """Consecutive steps with equal `signature(step)`, as lists."""
  return [list(g) for _, g in itertools.groupby(steps, key=signature)]


def _loops(forward, backward, n: int, fence: bool, stages: int):
  """The steps with `loop` set. The default schedule loops over the middle
  layers (forward: all but the last, and layer 0 when split; backward: all
  but the last, the first and, with HSDP, the one before the last), even
  one layer, in a `lax.scan`, and over the last layer where its step does
  what the loop's do (`Step.again`); the fenced schedules loop over each run of
  more than one step that do the same."""
  layer_steps = lambda steps: [s for s in steps if "layer" in s.compute
                               and not s.split]
  fwd_runs = runs(layer_steps(forward), forward_signature)
  run_of = lambda i: next(k for k, r in enumerate(fwd_runs)
                          if any(s.layer == i for s in r))
  bwd_runs = runs(layer_steps(backward), lambda s: backward_signature(s, run_of))
  if fence:
    looped = {id(s) for r in fwd_runs + bwd_runs if len(r) > 1 for s in r}
  else:
    looped = {id(s) for s in layer_steps(forward)
              if s.layer < n - 1 or s.again}
    first_looped = n - 2 if stages == 1 else n - 3
    looped |= {id(s) for s in layer_steps(backward)
               if 0 < s.layer <= first_looped or s.again}
  mark = lambda steps: [s._replace(loop=id(s) in looped) for s in steps]
  return mark(forward), mark(backward)


def fsdp_plan(n_layers: int, *, prefetch: int = 1,
              reshard_after_forward: bool | int = 1, replica_axis=None,
              bucket: bool = True, before=None, after=None,
              has_ys: bool = False, shard_map: bool = True) -> FsdpPlan:
  """The steps `fsdp_scan` runs with these settings, as a table to read.

  Takes `fsdp_scan`'s own settings (`before`/`after`: a function or None, or
  True/False; `replica_axis`: a name for HSDP, or None) and the number of
  layers; `shard_map=False` plans for an explicit-sharding mesh. Each step
  names what it computes, which layers' gathers are in flight across it,
  which layer's gradient it reduce-scatters (and, with HSDP, all-reduces),
  where its weights come from and whether it keeps them for the backward
  pass. A setting that cannot be run raises the error `fsdp_scan` would.

  Example:
    >>> import jax_overlap
    >>> plan = jax_overlap.fsdp_plan(3, prefetch=1)
    >>> [(s.says(), s.gathers) for s in plan.forward]
    [('layer 0 [split by use]', (0, 1)), ('layer 1', (2,)), ('layer 2', ())]
    >>> [(s.says(), s.scatters) for s in plan.backward][-1]
    ("layer 0's backward [split by use]", (1, 0))
  """
  return plan(n_layers, prefetch=prefetch,
              reshard_after_forward=reshard_after_forward,
              futures=bool(shard_map), hsdp=replica_axis is not None,
              bucket=bucket, before=_given(before), after=_given(after),
              has_ys=has_ys, split=use_order.ENABLED)


def _given(fn) -> bool:
  return fn is True or (fn is not None and fn is not False)
