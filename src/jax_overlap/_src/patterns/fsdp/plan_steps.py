"""`fsdp_scan`'s plan as data: its steps, the runs that execute them, and
how both print.

A `Step` is one row of the plan's table: what it computes and what moves
across that compute. A `Run` is one call of the executor (engine.py):
consecutive steps of a pass that one function runs, one by one or as one
`lax.scan`, with every choice that function needs written in its fields.
`FsdpPlan` holds the steps of each pass and the runs of each pass, the
forward pass without a gradient (`primal`) included. The planner is
plan.py; the printed form is pinned by
tests/patterns/fsdp/fsdp_plan_test.py::test_the_plan_prints_as_a_table.
"""

from __future__ import annotations

from typing import NamedTuple


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
    reduce-scatters a zero gradient (nothing is pending yet). Over an axis
    of one device, layer 0's backward step too: it gathers layer 0 again
    (as the loop's steps gather the layer below theirs; nothing moves).
    None of these is in `gathers` / `scatters`: each moves no layer the
    schedule needs.
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
    """What the step computes, in words (the report's name for it)."""
    words = {"before": "before(x)", "after": "after(y)",
             "after_back": "after's backward",
             "before_back": "before's backward",
             "layer": f"layer {self.layer}",
             "layer_back": f"layer {self.layer}'s backward",
             "": "(nothing: waited for at once)"}
    said = ", then ".join(words[c] for c in self.compute.split("+"))
    return said + (" [split by use]" if self.split else "")


#: What each kind of run does (engine.py has one function a kind).
RUN_KINDS = {
    "enter": "before(x) (or nothing) with layer 0's gather in flight",
    "enter_split": "before(x) and layer 0 in one block, layer 0's gathers "
                   "in groups by first use, layer 1's gather behind them",
    "layers": "the layer steps, each with its gathers in flight",
    "leave": "after(y) on the last layer's output (or the output as is)",
    "leave_back": "after's backward (or nothing) with the listed regather "
                  "in flight",
    "layers_back": "the layers' backward steps, each with its regathers and "
                   "the step before's reduce-scatter in flight",
    "back_split": "layer 0's backward, its gradients reduce-scattered in "
                  "groups as they are finished, then before's backward",
    "reduce": "HSDP: layer 1's all-reduce over the replicas, waited for",
    "enter_back": "before's backward (or nothing) with layer 0's "
                  "reduce-scatter in flight",
}


class Run(NamedTuple):
  """Consecutive steps of one pass that one function of the executor runs
  (`kind`, one of `RUN_KINDS`). Only the fields of its kind are set.

  steps: the steps it runs; the report names the run by them (a loop by
    its first and last).
  loop: layers, layers_back: one `lax.scan` over the steps' layers (its
    `unroll` the plan's), else one call a step.
  gathers: leave_back: the layers regathered (absolute); layers,
    layers_back: each step's gathers relative to its layer.
  keep: layers: each step saves its gathered weights for the backward pass.
  clamp: layers: a gather past the last layer gathers the last (the
    forward pass's `again` step, and every run of that pass beside it);
    layers_back: a gather below layer 0 gathers layer 0 (its `again`).
  stacks: layers: each step writes its residuals into stacks carried
    through the loop, inside its compute (else the loop's ys).
  kept: layers_back: the weights are the forward pass's kept copies (else
    the buffer of regathered layers).
  pending: layers_back: the transfers of the step before that each step
    finishes: 1 its reduce-scatter, 2 also its all-reduce (HSDP).
  again: layers_back: the first step reads the last layer's weights from
    the copy the forward pass gathered again, with a zero gradient pending;
    leave: that copy (the buffer's head) is saved for the backward pass.
  otherwise: enter_split, back_split: the runs that run instead of this
    one and every run after it in the pass, where the traced layer gives
    one group (the split would gain nothing).
  """
  kind: str
  steps: tuple = ()
  loop: bool = False
  gathers: tuple = ()
  keep: bool = False
  clamp: bool = False
  stacks: bool = False
  kept: bool = False
  pending: int = 0
  again: bool = False
  otherwise: tuple = ()

  def says(self, number) -> str:
    """The run in one line; `number(step)`: the step's # in its pass."""
    nums = [number(s) for s in self.steps]
    where = "" if not nums else (
        f" {nums[0]}" if len(nums) == 1 else f" {nums[0]}-{nums[-1]}")
    said = []
    if self.loop:
      said.append("one loop")
    if self.gathers and self.kind in ("layers", "layers_back"):
      said.append("gathers " + ", ".join(f"{g:+d}" for g in self.gathers))
    elif self.gathers:
      said.append("gathers " + ", ".join(map(str, self.gathers)))
    again = ("keeps the last layer's copy gathered again"
             if self.kind == "leave" else
             "first from the copy gathered again, a zero gradient pending")
    said += [word for flag, word in (
        (self.keep, "keeps its weights"),
        (self.clamp, "gathers clamped to the last layer" if self.kind == "layers"
         else "gathers clamped to layer 0"),
        (self.stacks, "residuals into carried stacks"),
        (self.kept, "kept weights"), (self.again, again),
        (self.pending == 1, "finishes the step before's reduce-scatter"),
        (self.pending == 2,
         "finishes the step before's reduce-scatter and all-reduce")) if flag]
    return f"{self.kind}{where}" + (f" ({'; '.join(said)})" if said else "")



class FsdpPlan:
  """The steps `fsdp_scan` runs for one set of settings (`fsdp_plan`).

  n_layers, prefetch, kept: the stack and the two memory knobs as numbers
    (`kept`: how many of the last layers keep their gathered weights).
  unroll: the layers a loop iteration runs.
  futures: the moves are futures (inside `jax.shard_map`), else reshards on
    an explicit-sharding mesh.
  moves: a gather moves anything (False: the fsdp axis has one device).
  stages: 2 with HSDP's all-reduce over the replicas (futures only), else 1.
  forward, backward: the steps, in the order they run (the table's rows).
  runs: pass name ("forward", "primal": the forward pass without a
    gradient, "backward") -> the runs that execute it, in order.
  notes: each setting that changed or did not change the steps, and why.
  fence_inputs: each layer step's inputs are fenced before its first
    operation (schedules that hold several gathered layers: without it XLA
    started their gathers steps early, each holding a gathered layer; the
    default schedule is not fenced so: tying a gather's start to the step's
    inputs cost TPU v5e a window in the backward pass, transfer.py); the
    backward pass then also reads the stack through a barrier.
  """

  def __init__(self, *, n_layers, prefetch, kept, unroll, futures, moves,
               stages, bucket, before, after, has_ys, forward, backward, runs,
               notes, fence_inputs):
    self.n_layers, self.prefetch, self.kept = n_layers, prefetch, kept
    self.unroll, self.moves = unroll, moves
    self.futures, self.stages, self.bucket = futures, stages, bucket
    self.before, self.after, self.has_ys = before, after, has_ys
    self.forward, self.backward = tuple(forward), tuple(backward)
    self.runs = dict(runs)
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
        # again: the forward step and layer 0's backward step gather their
        # own layer again, the last layer's backward step scatters zeros
        again = s.again and (name == "forward" or s.layer == 0)
        rows.append((name, str(k), s.says(),
                     f"{s.layer} again" if again else _layers(s.gathers),
                     "zeros" if s.again and not again else _layers(s.scatters),
                     _layers(() if s.reduce is None else (s.reduce,)),
                     s.weights or "-", "yes" if s.keeps else "-",
                     "yes" if s.loop else "-"))
    return _columns(head, rows)

  def run_table(self) -> str:
    """The runs of each pass, one line a pass (steps by their # in the
    table; the forward pass's for "primal"), and the runs that replace a
    split run where the layer gives one group."""
    lines = []
    for name in ("forward", "primal", "backward"):
      steps = self.backward if name == "backward" else self.forward
      number = lambda s, steps=steps: _number(steps, s)
      runs = self.runs[name]
      lines.append(f"  {name}: " + " | ".join(r.says(number) for r in runs))
      for r in runs:
        if r.otherwise:
          lines.append("    one group: " + " | ".join(
              o.says(number) for o in r.otherwise))
    return "\n".join(lines)

  def __str__(self) -> str:
    where = ("futures inside jax.shard_map" if self.futures
             else "jax.reshard on an explicit-sharding mesh")
    where += "" if self.moves else " over one device (nothing moves)"
    title = (f"fsdp_scan plan: {self.n_layers} layers, prefetch={self.prefetch}, "
             f"{self.kept} kept for the backward pass, unroll={self.unroll}, "
             f"{where}" + (", HSDP" if self.stages == 2 else ""))
    return "\n".join([title, self.table(), "runs (primal: without a gradient):",
                      self.run_table(), "notes:"]
                     + [f"  - {n}" for n in self.notes])

  def __repr__(self) -> str:
    return (f"FsdpPlan(n_layers={self.n_layers}, prefetch={self.prefetch}, "
            f"kept={self.kept}, steps={len(self.steps)})")


def _layers(layers) -> str:
  return ", ".join(map(str, layers)) if layers else "-"


def _number(steps, step) -> int:
  """`step`'s # in `steps`: the equal step's, else (a step changed for a
  run: layer 0 joining the loop) the one computing the same layer."""
  if step in steps:
    return steps.index(step)
  return next(k for k, s in enumerate(steps) if s.layer == step.layer)


def _columns(head, rows) -> str:
  widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
  line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
  return "\n".join([line(head), line(tuple("-" * w for w in widths))]
                   + [line(r) for r in rows])
