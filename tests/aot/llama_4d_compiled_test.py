"""examples/llama_4d.py's four plans on the real TPU v5e and H100 compilers,
ahead of time: each plan's `value_and_grad` compiles, and each axis's
collectives are async pairs with compute in flight.

Each plan's mesh is the target's 8 devices (`v5e:2x4`, H100 `1x1x8`) in its
axes' order, the model at width 256 (8 query heads, 4 key/value heads, hidden
512, vocab 1024, 4 blocks, 2 a stage), sequences of 256, 2 microbatches. A
collective's axes are read from its groups in the scheduled module
(mesh_axes.py), its window from the schedule (schedule.py; a window "with
compute" holds a fusion, a matmul, a custom call or a conditional), each
loop body's windows counted once per iteration. What each axis carries:

- stage sends: collective-permutes over 'pp' (pipeline_loss's ppermute_start);
- FSDP gathers / reduce-scatters: all-gathers and reduce-scatters over
  'fsdp' (fsdp_scan's futures; on TPU a reduce-scatter future is an
  all-to-all, its form there); FSDP permutes: both as collective-permutes
  over 'fsdp', their form on the v5e beside a layer that starts all-to-alls
  of its own (pp_fsdp_ep's expert stream: patterns/fsdp/all_to_all_slot.py);
- TP ring permutes: collective-permutes over 'tp' (all_gather_matmul and
  matmul_reduce_scatter); TP all-reduces: over 'tp', the blocks' sums
  (tensor="psum": the chunked stream's psum_start futures typed varying,
  forward and backward; on TPU each is its form there, an all-to-all over 2
  devices, quirks.py "tpu-collective-forms") and the sums of the gradients
  of leaves replicated over 'tp' (the norm scales: pp_fsdp_tp's by
  pipeline_loss's mean_axes, pp_dp_tp's by a pvary_start future; on the
  v5e the embedding, final norm and head's sum over 'tp' too);
- CP rotations: collective-permutes over 'cp' (ring_attention);
- EP exchanges: all-to-alls over 'ep' (expert_parallel);
- DP gradient sums: collectives over 'dp' alone, the sums of the gradients
  of the blocks' weights (replicated over 'dp'), which pipeline_loss
  (mean_axes=('dp', 'tp')) starts as futures once its ticks end: on the H100
  an all-reduce a leaf, on the v5e `psum_start`'s TPU form over 2 devices, one
  all-to-all for the leaves joined; on the v5e also the sums over 'dp' of
  the norm scales (pp_dp_tp casts them with a `pvary_start` future over
  ('dp', 'tp'), on TPU one a mesh axis) and of the embedding, final norm and
  head. In no column: on the H100 those two are one sum over all their
  axes each; the loss's mean over 'pp', 'dp' and 'tp'.
- PP gradient sums: collectives over 'pp' alone: on the v5e the sum over
  'pp' of the embedding's, final norm's and head's gradients (llama_4d
  casts them with one `pvary_start` future over every axis, on TPU one a
  mesh axis: their sums over 'fsdp', 'tp', 'dp' and 'ep' land in those
  axes' columns); on the H100 that future is one sum over every axis (no
  column), and this column holds what XLA sums over 'pp' alone.

`python tests/aot/llama_4d_compiled_test.py` (in .venv-aot) prints the table
of docs/pipeline.md's "Composing the axes" (async pairs / with compute in
flight, and the synchronous ones). Every test here is slow: a plan's compile
takes 1-4 minutes; each (plan, target) compiles once a process.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import sys

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import mesh_axes
import schedule
from compilers import target
from jax_overlap._src import _compat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import llama_4d  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                       reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU"),
]

TARGETS = ("gpu_h100", "tpu_v5e")
SEQ = 256
CFG = dict(vocab=1024, d=256, heads=8, kv_heads=4, head_dim=32, hidden=512, layers=4)

#: (column, HLO kinds, the axes it runs over)
CATEGORIES = [
    ("stage sends", ("collective-permute",), {"pp"}),
    ("FSDP gathers", ("all-gather",), {"fsdp"}),
    ("FSDP reduce-scatters", ("reduce-scatter", "all-to-all"), {"fsdp"}),
    # both, as permutes: on the v5e beside a layer's all-to-alls
    # (patterns/fsdp/all_to_all_slot.py)
    ("FSDP permutes", ("collective-permute",), {"fsdp"}),
    ("TP ring permutes", ("collective-permute",), {"tp"}),
    ("TP all-reduces", ("all-reduce", "all-to-all", "all-gather"), {"tp"}),
    ("CP rotations", ("collective-permute",), {"cp"}),
    # an all-to-all future's synchronous fallback (its slot taken) is all-gathers
    ("EP exchanges", ("all-to-all", "all-gather"), {"ep"}),
    ("DP gradient sums", ("all-reduce", "all-to-all", "all-gather", "reduce-scatter"),
     {"dp"}),
    ("PP gradient sums", ("all-reduce", "all-to-all", "all-gather"), {"pp"}),
]
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                "collective-permute")


def expected(plan) -> set[str]:
  """The columns `plan` must fill."""
  out = {"stage sends"}
  if "fsdp" in plan.axes:
    out |= {"FSDP gathers", "FSDP reduce-scatters"}
  if "tp" in plan.axes:
    out.add("TP ring permutes" if plan.tensor == "collective" else "TP all-reduces")
  if "cp" in plan.axes:
    out.add("CP rotations")
  if "ep" in plan.axes:
    out.add("EP exchanges")
  return out


def _category(kind: str, axes) -> str | None:
  for column, kinds, want in CATEGORIES:
    if kind in kinds and axes == want:
      return column
  return None


@dataclasses.dataclass(frozen=True)
class Count:
  pairs: int = 0         # async start/done pairs, a loop body's once an iteration
  computing: int = 0     # of them with compute between start and done
  sync: int = 0          # the same collectives compiled synchronous
  matmul: int = 0        # of the pairs, those with a matmul between


def _plan_on(name: str, plan_name: str):
  t = target(name)
  return dataclasses.replace(llama_4d.PLANS[plan_name], devices=tuple(t.mesh.devices.flat))


@functools.cache
def compiled_text(name: str, plan_name: str) -> str:
  plan = _plan_on(name, plan_name)
  cfg = llama_4d.Config(experts=4 if "ep" in plan.axes else 0, **CFG)
  shapes = jax.eval_shape(lambda: plan.stage(llama_4d.init(cfg, jax.random.key(0))))
  mesh = plan.mesh
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, s)), shapes, plan.specs(shapes))
  tokens = jax.ShapeDtypeStruct((llama_4d.batch_size(plan), SEQ), jnp.int32,
                                sharding=NamedSharding(mesh, plan.batch_spec()))
  return compilers.compiled_text(jax.value_and_grad(plan.loss), params, tokens, tokens)


@functools.cache
def counts(name: str, plan_name: str) -> dict[str, Count]:
  """Column -> Count for `plan_name` compiled for target `name`."""
  plan = _plan_on(name, plan_name)
  text = compiled_text(name, plan_name)
  shape, names = tuple(plan.axes.values()), tuple(plan.axes)
  found = collections.defaultdict(Count)
  for w in schedule.runs(text, schedule.windows(text)):
    column = _category(w.kind, mesh_axes.window_axes(text, w, shape, names))
    if column:
      computing = any(i.is_matmul or i.opcode in ("fusion", "custom-call", "convolution",
                                                  "conditional") for i in w.between)
      c = found[column]
      found[column] = dataclasses.replace(c, pairs=c.pairs + 1,
                                          computing=c.computing + computing,
                                          matmul=c.matmul + bool(w.matmuls))
  for comp, instrs in schedule.scheduled(text).items():
    for i in instrs:
      kind = i.opcode if i.opcode in _COLLECTIVES else next(
          (k for k in _COLLECTIVES if "is_sync=true" in i.line and f"{k}-start" in i.line), None)
      if kind is None:
        continue
      axes = mesh_axes.named_axes(i.line)
      if axes is None:
        groups = mesh_axes.groups_of(i.line)
        axes = mesh_axes.axes_of(groups, shape, names) if groups is not None else None
      column = _category(kind, axes)
      if column:
        found[column] = dataclasses.replace(found[column], sync=found[column].sync + 1)
  return dict(found)


def without_compute(column: str, c: Count) -> int:
  """How many of a column's pairs may have no compute in flight: the
  pipeline's last send (the drain: its tick after has nothing left to run on
  that device), an expert_parallel pass's first all-to-all (before any
  expert runs) and last (after every one ran), an fsdp_scan pass's last
  reduce-scatter (after its last layer's backward; v5e's form is an
  all-to-all, one in flight at a time), and of the TP sums half (a
  matmul_psum call in 2 chunks leaves its last sum forward and first
  backward alone; llama_4d's chunked stream, only its last forward and
  first backward sum a stage pass)."""
  return {"stage sends": 1, "EP exchanges": c.pairs // 2,
          "FSDP reduce-scatters": 2, "FSDP permutes": 2,
          "TP all-reduces": c.pairs // 2}.get(column, 0)


#: (plan, target) -> column -> (async pairs, of them with compute in flight),
#: as compiled on 2026-12-06 (jax 0.12.0.1, libtpu 0.0.52, jax-cuda12-plugin
#: 0.12.0.1; docs/pipeline.md's table): a column may not have fewer pairs
#: with compute, nor more without. A change that moves them (the model, the
#: library, the compilers) updates this and the table together.
MEASURED = {
    # (the embedding, final norm and head cast by a pvary_start future over
    # every axis, llama_4d._varying: on the v5e their gradients' sum one
    # future a mesh axis, counted in the FSDP reduce-scatter, TP all-reduce,
    # EP exchange, DP and PP columns; pp_fsdp_tp's norm scales summed over
    # 'tp' by mean_axes when the ticks end, pp_dp_tp's by a pvary_start
    # future over ('dp', 'tp'), 18:26 UTC)
    ("pp_fsdp_tp", "gpu_h100"): {"stage sends": (4, 3), "FSDP gathers": (18, 18),
                                 "FSDP reduce-scatters": (6, 6), "TP ring permutes": (60, 60),
                                 "TP all-reduces": (2, 2)},
    ("pp_fsdp_tp", "tpu_v5e"): {"stage sends": (4, 4), "FSDP gathers": (42, 42),
                                "FSDP reduce-scatters": (7, 7), "TP ring permutes": (81, 81),
                                "TP all-reduces": (2, 2), "PP gradient sums": (1, 1)},
    ("pp_fsdp_cp", "gpu_h100"): {"stage sends": (4, 4), "FSDP gathers": (18, 18),
                                 "FSDP reduce-scatters": (6, 6), "CP rotations": (18, 18),
                                 "PP gradient sums": (2, 1)},
    ("pp_fsdp_cp", "tpu_v5e"): {"stage sends": (4, 4), "FSDP gathers": (33, 33),
                                "FSDP reduce-scatters": (7, 7), "CP rotations": (24, 24),
                                "PP gradient sums": (1, 1)},
    # (the drain send synchronous: its window held only a mask slice, which
    # now fuses with the chunking slice that reads it)
    # (the DP sums one future a leaf on the H100, joined in one on the v5e:
    # psum_start's TPU form there, one all-to-all in flight at a time)
    # (2026-12-07: its stage's weight-only residuals no longer kept a row a
    # microbatch (pipeline/residuals.py): the drain send async again, 3 more
    # sums with compute)
    ("pp_dp_tp", "gpu_h100"): {"stage sends": (4, 4), "TP all-reduces": (48, 46),
                               "DP gradient sums": (7, 7)},
    ("pp_dp_tp", "tpu_v5e"): {"stage sends": (4, 4), "TP all-reduces": (68, 63),
                              "DP gradient sums": (3, 3), "PP gradient sums": (1, 1)},
    # (the stage's blocks through expert_stream, llama_4d.moe_stream: every
    # EP exchange in flight; each FSDP bucket now one gather / reduce-scatter
    # where XLA cut some in 3-4 before (the same buckets and bytes); on the
    # H100 one more stage send has only the next gather's start beside it)
    ("pp_fsdp_ep", "gpu_h100"): {"stage sends": (4, 2), "FSDP gathers": (9, 9),
                                 "FSDP reduce-scatters": (6, 6), "EP exchanges": (48, 48),
                                 "PP gradient sums": (1, 0)},
    # (on the v5e fsdp_scan moves by permutes beside the stream's all-to-alls,
    # which then hold the one slot: none synchronous, where 10 exchanges and
    # 2 FSDP pieces were)
    # (and the embedding/final norm/head's sums over 'fsdp', 'ep' and 'pp',
    # pvary_start's, one all-to-all each)
    # (2026-12-07: the v5e's default recompute keeps what the stage's
    # all-to-alls received (all_to_alls_saveable): the backward no longer
    # exchanges again, 73 -> 49 exchanges, 27 -> 21 FSDP permutes)
    ("pp_fsdp_ep", "tpu_v5e"): {"stage sends": (4, 4), "FSDP permutes": (21, 21),
                                "EP exchanges": (49, 49), "FSDP reduce-scatters": (1, 1),
                                "PP gradient sums": (1, 1)},
}
#: (plan, target, column) -> pairs allowed without compute where a plan
#: needs more than `without_compute` says. pp_fsdp_ep's H100 forward sends
#: of warm-up ticks: their windows hold the next tick's FSDP gather start
#: and no model compute (before expert_stream they held that gather's
#: bucket concatenate and a transpose of one of its pieces, counted as
#: compute; since, XLA builds the bucket before the send starts).
BARE = {("pp_fsdp_ep", "gpu_h100", "stage sends"): 2}
#: The psum plan's TP sums with a matmul in flight, as measured (with MEASURED).
TP_SUMS_WITH_A_MATMUL = {("pp_dp_tp", "gpu_h100"): 43, ("pp_dp_tp", "tpu_v5e"): 60}


#: Which (target, plan) the compiler refuses, and how (xfail, strict): none
#: now. Before 1c5d4d3's pipeline (its stage a Python loop over its layers)
#: the H100 compiler refused pp_dp_tp ("Asynchronous computation
#: async_computation expected to contain only the root and parameter
#: instructions": layout normalization put bitcasts of a stage send's
#: {1,0,2} layout inside its async computation).
REFUSED: dict = {}


def _cases():
  out = []
  for plan_name in sorted(llama_4d.PLANS):
    for name in TARGETS:
      why = REFUSED.get((name, plan_name))
      marks = [pytest.mark.xfail(reason=why, strict=True,
                                 raises=jax.errors.JaxRuntimeError)] if why else []
      out.append(pytest.param(name, plan_name, marks=marks, id=f"{plan_name}-{name}"))
  return out


@pytest.mark.parametrize("name, plan_name", _cases())
def test_every_axis_is_in_flight_over_compute(name, plan_name):
  plan = _plan_on(name, plan_name)
  found = counts(name, plan_name)
  print(name, plan_name, found)
  print(row(name, plan_name))      # pytest -s: the docs table's row
  need = expected(plan)
  if "FSDP permutes" in found:   # both FSDP columns, as permutes
    need = need - {"FSDP gathers", "FSDP reduce-scatters"} | {"FSDP permutes"}
  for column in need:
    c = found.get(column, Count())
    if column == "TP all-reduces" and plan.tensor != "psum":
      # the norm scales' gradients' sum (pipeline_loss's mean_axes) and, on
      # the v5e, the embedding/final norm/head's (a pvary_start future):
      # async (autodiff's own sum was synchronous on the v5e)
      assert c.pairs and not c.sync, f"{column}: none, or synchronous ({found})"
      continue
    if column == "TP all-reduces":
      # the chunked stream (llama_4d.chunked_stream): every sum async, and
      # at least half of them with a matmul in flight (all but a stage
      # pass's last forward sum and first backward sum: the other chunk's
      # part forward, the backward of the part written after it backward)
      assert c.pairs and not c.sync, f"{column}: synchronous ({found})"
      assert 2 * c.matmul >= c.pairs, f"{column}: windows without a matmul ({found})"
    assert c.pairs, f"{column}: no async pair ({found})"
    bare = max(without_compute(column, c), BARE.get((plan_name, name, column), 0))
    assert c.computing >= c.pairs - bare, \
        f"{column}: windows without compute ({found})"
  if "dp" in plan.axes:
    # the blocks' gradient sums over 'dp', futures pipeline_loss starts when
    # its ticks end (mean_axes): every one async with compute beside it
    c = found.get("DP gradient sums", Count())
    assert c.pairs and not c.sync and c.computing == c.pairs, \
        f"DP gradient sums: synchronous or without compute ({found})"
  for column, (pairs, computing) in MEASURED[plan_name, name].items():
    c = found.get(column, Count())
    assert c.computing >= computing and c.pairs - c.computing <= pairs - computing, (
        f"{column}: {c.pairs} async pairs, {c.computing} with compute in flight; "
        f"measured {pairs} / {computing} (MEASURED): fewer in flight ({found})")
  want = TP_SUMS_WITH_A_MATMUL.get((plan_name, name))
  if want is not None:
    c = found["TP all-reduces"]
    assert c.matmul >= want, f"TP all-reduces: {c.matmul} with a matmul, measured {want}"


def row(name: str, plan_name: str) -> str:
  """The table's row of `plan_name` compiled for target `name`."""
  columns = [c for c, _, _ in CATEGORIES]
  label = {"gpu_h100": "H100 x8", "tpu_v5e": "TPU v5e 2x4"}[name]
  try:
    found = counts(name, plan_name)
  except Exception as e:  # noqa: BLE001 - a refused compile is a row too
    return (f"| `{plan_name}` | {label} | does not compile: "
            f"{str(e).splitlines()[0][:90]} |" + " |" * (len(columns) - 1))

  def cell(column):
    c = found.get(column)
    if c is None:
      return ""
    return f"{c.pairs} / {c.computing}" + (f" ({c.sync} sync)" if c.sync else "")
  return f"| `{plan_name}` | {label} | " + " | ".join(map(cell, columns)) + " |"


def table() -> str:
  """The markdown table of every (plan, target)."""
  columns = [c for c, _, _ in CATEGORIES]
  rows = ["| plan | target | " + " | ".join(columns) + " |",
          "|---|---|" + "---|" * len(columns)]
  rows += [row(name, plan_name) for plan_name in llama_4d.PLANS for name in TARGETS]
  return "\n".join(rows)


if __name__ == "__main__":
  import importlib.metadata as md  # noqa: PLC0415
  print(table())
  print(f"\njax {jax.__version__}, libtpu {md.version('libtpu')}, "
        f"jax-cuda12-plugin {md.version('jax-cuda12-plugin')}")
  for plan_name in llama_4d.PLANS:
    for name in TARGETS:
      c = counts(name, plan_name).get("TP all-reduces")
      if c and c.pairs:
        print(f"{plan_name} {name}: TP all-reduces with a matmul in flight: "
              f"{c.matmul} of {c.pairs}")
