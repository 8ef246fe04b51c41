"""`fsdp_scan`'s planner: its settings turned into steps, and the steps into
the runs the executor calls.

Each step names what it computes (`before`, a layer, a layer's backward,
`after`'s backward, `before`'s backward), which layers' gathers are in flight
across that compute, which layer's gradient is reduce-scattered (HSDP: which
one is all-reduced over the replicas), where the layer's weights come from
and whether the step keeps them for the backward pass. Every choice of how
the steps run is made here too and written into the plan's runs
(plan_steps.Run): which steps run as one loop, each step's gathers relative
to its layer, what the forward pass without a gradient runs, the loops'
unroll, and what runs where the layer-0 split finds one group. The executor
(engine.py) reads the plan and nothing else; `jax_overlap.fsdp_plan(...)`
returns it to read.

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

import numpy as np

from jax_overlap._src import _compat
from jax_overlap._src.patterns.fsdp import use_order
from jax_overlap._src.patterns.fsdp.plan_steps import FsdpPlan, Run, Step

#: The layer-0 split (use_order.py) is planned only with the default schedule
#: shape, the one measured on the real compilers (tests/aot).
_SPLIT_WHEN = "prefetch=1 and reshard_after_forward True or 1"


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


def check_unroll(unroll) -> None:
  if unroll is not None and (isinstance(unroll, bool)
                             or not isinstance(unroll, int) or unroll < 1):
    raise ValueError(f"fsdp_scan(unroll=...) must be an int >= 1 or None, "
                     f"got {unroll!r}.")


def loops_unroll(unroll, p: int, kept: int, futures: bool) -> int:
  """The layers a loop iteration runs for `fsdp_scan(unroll=...)`: None
  gives p (1 with the default prefetch); loops that carry several gathered
  layers (kept > 1 or p > 1) round it up to a multiple of p
  (`loop_unroll`), where this jax can unroll them (an explicit mesh's
  kept layers, `_compat.unroll_saving_reduced`)."""
  unroll = p if unroll is None else unroll
  if kept > 1 or p > 1:
    if kept and not futures:
      unroll = _compat.unroll_saving_reduced(unroll)
    unroll = loop_unroll(unroll, p)
  return unroll


def loop_unroll(unroll: int, p: int) -> int:
  """The loops' unroll: `unroll` rounded up to a multiple of the prefetch
  depth `p` (unroll=1 stays 1). Each step shifts the carried buffer of
  gathered layers by one; over a multiple of p steps each buffered layer
  ends the iteration in the slot it started in, else XLA copies every
  buffered layer at each iteration's end
  (tests/patterns/fsdp/fsdp_memory_knobs_test.py)."""
  return unroll if unroll == 1 else -(-unroll // p) * p


def plan(n_layers: int, *, prefetch=1, reshard_after_forward=1,
         unroll=None, futures: bool = True, moves: bool = True,
         hsdp: bool = False, bucket: bool = True, before: bool = False,
         after: bool = False, has_ys: bool = False,
         split: bool = True) -> FsdpPlan:
  """The plan for these settings, or a ValueError/TypeError naming the
  setting that cannot be run and why. `moves`: whether a gather moves
  anything (False: the fsdp axis has one device, transfer.py's `moves`);
  `split`: whether the layer-0 split is wanted (`use_order.split_wanted()`:
  off within `use_order.layer_0_whole()`); the plan says where it applies."""
  if isinstance(n_layers, (bool, np.bool_)) \
      or not isinstance(n_layers, numbers.Integral) or n_layers < 1:
    raise ValueError(f"fsdp_plan(n_layers=...) must be an int >= 1 (the "
                     f"layers of the stack), got {n_layers!r}.")
  for value, name in ((futures, "futures"), (hsdp, "hsdp"), (bucket, "bucket"),
                      (before, "before"), (after, "after"), (has_ys, "has_ys"),
                      (split, "split"), (moves, "moves")):
    check_bool(value, name)
  n = int(n_layers)
  kept = kept_layers(reshard_after_forward, n)
  p = prefetch_depth(prefetch, n)
  check_unroll(unroll)
  unroll = loops_unroll(unroll, p, kept, futures)
  stages = 2 if hsdp and futures else 1
  default_shape = kept <= 1 and p == 1
  notes = []
  if prefetch != p:
    notes.append(f"prefetch={prefetch} gathers {p} ahead: no more layers "
                 "are left to gather.")
  split_fwd = split and futures and moves and n >= 2 and default_shape
  split_bwd = split_fwd and stages == 1
  if not split:
    notes.append("layer 0's split by use order is off: its weights and its "
                 "gradient each travel as one transfer.")
  elif not futures:
    notes.append("layer 0 is not split by use order: on an explicit-sharding "
                 "mesh XLA's partitioner makes the collectives.")
  elif not moves:
    notes.append("over an axis of one device nothing moves (no collective, "
                 "no bucket): layer 0 is not split by use order.")
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
  if bucket and futures and moves:
    notes.append("bucket: each transfer moves all of a layer's sharded leaves "
                 "of one dtype in one collective.")
  elif not bucket and futures and moves:
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
  # Layer 0's backward in the loop too (Step.again): where its gathers move
  # nothing, its step gathers layer 0 again (clamped), as the loop's steps
  # gather the layer below theirs; each pass then holds the layer once
  # (each copy outside the loops is compiled again: docs/fsdp.md,
  # "Compile time").
  fold_first = fold and not moves
  if fold_first:
    notes.append("layer 0's backward runs in the loop: its step gathers "
                 "layer 0 again (over one device, nothing moves).")
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
        split=split_bwd and i == 0,
        again=fold and i == n - 1 or fold_first and i == 0))
  if stages == 2 and n >= 2:
    backward.append(Step("", reduce=1))
  if not split_bwd:
    backward.append(Step("before_back" if before else "", scatters=(0,),
                         reduce=0 if stages == 2 else None))
  forward, backward = _loops(forward, backward, n, fence, stages)
  stacks = futures and unroll == 1
  passes = {
      "forward": _forward_runs(forward, save=True, fold=fold, fence=fence,
                               stacks=stacks),
      "primal": _forward_runs(forward, save=False, fold=fold, fence=fence,
                              stacks=stacks, moves=moves),
      "backward": _backward_runs(forward, backward)}
  return FsdpPlan(n_layers=n, prefetch=p, kept=kept, unroll=unroll,
                  futures=futures, moves=moves, stages=stages, bucket=bucket, before=before,
                  after=after, has_ys=has_ys, forward=forward,
                  backward=backward, runs=passes, notes=notes,
                  fence_inputs=fence)


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
  saved_by = {s.layer: k for k, r in enumerate(fwd_runs) for s in r}
  run_of = saved_by.get   # (None: layer 0, split)
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


# --- the runs: which steps each call of the executor runs -------------------------


def _forward_runs(forward, *, save: bool, fold: bool, fence: bool,
                  stacks: bool, moves: bool = True) -> tuple:
  """The runs of the forward pass (`save`: with a gradient, else the
  primal pass). Consecutive layer steps that do the same relative to their
  layer run as one, in one loop where the plan loops them. Without a
  gradient nothing is kept: a fenced schedule's runs then join across the
  kept layers' first step, and loop where longer than one step; the last
  layer's `again` step runs on its own (nothing to gather again for), but
  where nothing moves, in the loop (its gather again costs nothing)."""
  entry, *steps = [s for s in forward if s.compute != "after"]
  after = [s for s in forward if s.compute == "after"]
  leave = Run("leave", tuple(after), again=save and fold)
  again_looped = save or not moves

  def signature(s):
    looped = s.loop if save or not fence else None
    if s.again:   # as the loop's steps with a gradient, else on its own
      return ((1,), s.buffered, False, True) if again_looped else \
          ((), s.buffered, False, False)
    return (_offsets(s), s.buffered, save and s.keeps, looped)

  def layer_runs(steps):
    out = []
    for run in runs(steps, signature):
      offsets, _, keep, looped = signature(run[0])
      looped = len(run) > 1 if looped is None else looped
      out.append(Run("layers", tuple(run), loop=looped, gathers=offsets,
                     keep=keep, clamp=again_looped and fold,
                     stacks=save and looped and stacks))
    return out

  if not entry.split:
    return (Run("enter", (entry,)), *layer_runs(steps), leave)
  # One group only: layer 0's gather behind `before` (named as planned),
  # layer 0 then runs with the layers after it.
  joined = entry._replace(gathers=entry.gathers[1:], split=False, buffered=1,
                          loop=True)
  otherwise = (Run("enter", (entry,)), *layer_runs([joined] + steps), leave)
  return (Run("enter_split", (entry,), otherwise=otherwise),
          *layer_runs(steps), leave)


def _backward_runs(forward, backward) -> tuple:
  """The runs of the backward pass. Consecutive layer steps that do the
  same relative to their layer, reading the residuals of one forward run,
  run as one. The `again` step runs as the loop's steps do: weights from
  the buffer (the copy the forward pass gathered again), a zero gradient
  pending."""
  steps = [s for s in backward if "layer_back" in s.compute]
  # the forward run that saved each layer (layer 0 split: the entry's)
  saved_by = {s.layer: k for k, r in enumerate(_forward_runs(
      forward, save=True, fold=False, fence=False, stacks=False))
              for s in r.steps if s.layer is not None}
  run_of = saved_by.__getitem__
  first = backward[0] if backward[0] is not steps[0] else None
  out = [Run("leave_back", () if first is None else (first,),
             gathers=() if first is None else first.gathers)]
  split = steps[-1] if steps[-1].split else None
  if split is not None:
    steps = steps[:-1]

  def signature(s):
    if s.again:   # layer 0's: the layer below, clamped to layer 0
      offsets = (-1,) if s.layer == 0 else _offsets(s)
      return (offsets, 1, "gathered", 1, run_of(s.layer), s.loop)
    return (*backward_signature(s, run_of), s.loop)

  for run in runs(steps, signature):
    offsets, _, weights, pending, _, looped = signature(run[0])
    out.append(Run("layers_back", tuple(run), loop=looped, gathers=offsets,
                   kept=weights == "kept", pending=pending,
                   clamp=any(s.again and s.layer == 0 for s in run),
                   again=run[0].again and run[0].layer != 0))
  if split is not None:
    # One group only: layer 0's backward as its own step, then before's
    # backward with layer 0's reduce-scatter (both named as planned).
    otherwise = (Run("layers_back", (split,), kept=split.weights == "kept",
                     pending=1), Run("enter_back", (split,)))
    return (*out, Run("back_split", (split,), otherwise=otherwise))
  reduce = [Run("reduce", (s,)) for s in backward
            if s.compute == "" and s.reduce is not None and not s.scatters]
  return (*out, *reduce, Run("enter_back", (backward[-1],)))


def _offsets(step) -> tuple:
  return tuple(g - step.layer for g in step.gathers)


def fsdp_plan(n_layers: int, *, prefetch: int = 1,
              reshard_after_forward: bool | int = 1, unroll: int | None = None,
              replica_axis=None, bucket: bool = True, before=None, after=None,
              has_ys: bool = False, shard_map: bool = True,
              axis_size: int | None = None) -> FsdpPlan:
  """The steps `fsdp_scan` runs with these settings, as a table to read.

  Takes `fsdp_scan`'s own settings (`before`/`after`: a function or None, or
  True/False; `replica_axis`: a name for HSDP, or None) and the number of
  layers; `shard_map=False` plans for an explicit-sharding mesh;
  `axis_size`: the devices along `axis` (None: more than one; over one,
  nothing moves and the plan runs every layer in the loops). Each step
  names what it computes, which layers' gathers are in flight across it,
  which layer's gradient it reduce-scatters (and, with HSDP, all-reduces),
  where its weights come from and whether it keeps them for the backward
  pass; `plan.runs` (printed below the table) are the executor's calls,
  each pass's, with every choice they read. A setting that cannot be run
  raises the error `fsdp_scan` would.

  Example:
    >>> import jax_overlap
    >>> plan = jax_overlap.fsdp_plan(3, prefetch=1)
    >>> [(s.says(), s.gathers) for s in plan.forward]
    [('layer 0 [split by use]', (0, 1)), ('layer 1', (2,)), ('layer 2', ())]
    >>> [(s.says(), s.scatters) for s in plan.backward][-1]
    ("layer 0's backward [split by use]", (1, 0))
    >>> [r.kind for r in plan.runs["forward"]]
    ['enter_split', 'layers', 'leave']
  """
  return plan(n_layers, prefetch=prefetch,
              reshard_after_forward=reshard_after_forward, unroll=unroll,
              futures=bool(shard_map),
              moves=not (shard_map and axis_size == 1),
              hsdp=replica_axis is not None,
              bucket=bucket, before=_given(before), after=_given(after),
              has_ys=has_ys, split=use_order.split_wanted())


def _given(fn) -> bool:
  return fn is True or (fn is not None and fn is not False)
