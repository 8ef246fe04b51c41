"""A stage's residuals, kept from its forward action to its backward ones.

With `recompute=False` (the default off TPU: `choose_recompute`) the
forward action takes `jax.vjp` of the stage and keeps the residuals the
backward needs; the backward actions
(B, or zero bubble's I and W) apply that vjp without running the stage's
forward again. The function `jax.vjp` returns is a pytree whose leaves are
the residual arrays: its structure is found once by tracing the stage on
the executor's types (`layout`), the leaves that are the stage's own inputs
(its parameters, the closed-over values, the kept stage input) are read
back from where they already live, the leaves computed from the stage's
parameters and closed-over values alone (a cast of the weights to bf16, a
transposed or sliced weight, a gathered one) are computed again in the
backward from the parameters by that part of the stage alone (`Weights`),
and only the others take rows of the executor's buffers: one row a
(microbatch, chunk) in flight, the rows the kept stage inputs use
(buffers.py), so the memory stays flat in m and holds no copy of the
weights per microbatch (a stage of unrolled blocks kept every block's
weights in each row: the bench's "gathered once" H100 row). A
residual typed as varying over fewer mesh axes than the buffers (one a
collective's position computes from its axis index alone, say) cannot come
back from them with its type; the backward computes it again from the
stage's inputs (XLA drops the rest of that second forward; ring attention
inside an FSDP stage has such residuals: llama_4d_test's pp_fsdp_cp). A
`jax.checkpoint` policy keeps what the policy saves and recomputes the rest
in the backward; `recompute=True` keeps nothing (the backward runs the
stage's forward again from the kept input). Pinned by
tests/patterns/pipeline/pipeline_residuals_test.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax._src import core as jax_core

from jax_overlap._src import _compat
from jax_overlap._src.collectives.remat_policy import all_to_alls_saveable
from jax_overlap._src.patterns.pipeline.depends import depends_on

#: A vjp leaf the backward computes again (`Layout.source`).
AGAIN = "again"
#: A vjp leaf computed from the stage's parameters and consts alone: the
#: backward computes it again from them (`Layout.weights`).
WEIGHTS = "weights"


def check_recompute(recompute) -> None:
  """A clear error for a `recompute` that is neither None, a bool nor a
  policy."""
  if recompute is None or isinstance(recompute, bool) or callable(recompute):
    return
  raise TypeError(
      f"pipeline_loss(recompute={recompute!r}): expected None (the default: "
      "True when the program is for TPU, False elsewhere), False (keep the "
      "stage's residuals), True (recompute the stage's forward in its "
      "backward) or a jax.checkpoint policy such as "
      "jax.checkpoint_policies.dots_saveable.")


def choose_recompute(recompute, exchanges: bool = False):
  """`recompute` as given; for None, on TPU (the platform of the mesh being
  traced over, where jax says; else `jax.default_backend()`) True, or
  `all_to_alls_saveable` where the stage holds an all-to-all (`exchanges`),
  and False elsewhere. Why: on the v5e compiler the pipeline's residual
  buffers (zero fills, copies, row writes) cost more than running the
  stage's forward again (1F1B bench 51.1 against 33.2 ms modelled), though
  keeping a stage's residuals ran 0.78x recomputing on the chip itself; on
  GPUs keeping them is faster (H100 0.89x). A backward that runs its
  stage's all-to-alls again has twice the exchanges to hide behind the
  other chunk of a DualPipeV tick (docs/pipeline.md, "DualPipeV").
  docs/pipeline.md, "Memory"; pinned by
  pipeline_residuals_test.py (CPU) and tests/aot/pipeline_compiled_test.py
  (`test_the_default_recomputes_on_tpu_and_keeps_residuals_on_gpu`),
  tests/aot/dualpipev_moe_compiled_test.py (the windows)."""
  check_recompute(recompute)
  if recompute is not None:
    return recompute
  platform, _ = _compat.trace_device()
  if (platform or jax.default_backend()) != "tpu":
    return False
  return all_to_alls_saveable if exchanges else True


def stage_vjp(fn: Callable, recompute, chunk, consts, x):
  """`(y, vjp)` of `fn(chunk, consts, x)`; the stage under
  `jax.checkpoint(policy=recompute)` where `recompute` is a policy."""
  if callable(recompute):
    fn = jax.checkpoint(fn, policy=recompute)
  return jax.vjp(fn, chunk, consts, x)


@dataclasses.dataclass(frozen=True)
class Weights:
  """The part of the stage that computes the vjp leaves marked `WEIGHTS`
  from the parameters and consts alone: `jaxpr` (closed, pure) takes the
  leaves `inputs` of `(chunk, consts)` and returns those vjp leaves, in
  order."""
  jaxpr: Any
  inputs: tuple

  def __call__(self, chunk, consts) -> list:
    given = jax.tree.leaves((chunk, consts))
    return jax_core.eval_jaxpr(_compat.open_jaxpr(self.jaxpr),
                               _compat.jaxpr_consts(self.jaxpr),
                               *[given[k] for k in self.inputs])


@dataclasses.dataclass(frozen=True)
class Layout:
  """The stage vjp's structure: `tree` its treedef; `source[k]` for its
  k-th leaf the index of the stage input leaf (of `(chunk, consts, x)`) it
  is, `WEIGHTS` where `weights` computes it from the parameters and consts,
  `AGAIN` where the backward's vjp computes it again, or None where it is
  kept in the buffers; `kept` the kept leaves' shapes and dtypes."""
  tree: Any
  source: tuple
  kept: tuple
  recompute: Any
  weights: Weights | None = None

  def split(self, vjp, inputs) -> list:
    """The leaves of `vjp` to keep (the forward action's)."""
    leaves, _ = jax.tree.flatten(vjp)
    expected = tuple(None if k in (AGAIN, WEIGHTS) else k for k in self.source)
    if _sources(leaves, inputs) != expected:
      raise AssertionError(
          "pipeline_loss: the stage's vjp has another structure in the "
          "forward action than when traced once; pass recompute=True.")
    return [a for a, k in zip(leaves, self.source) if k is None]

  def join(self, kept, inputs, again: Callable):
    """The stage's vjp from the kept leaves and the stage inputs (the
    backward action's); `again()` gives the vjp computed again, for the
    leaves that are not kept."""
    given, kept = jax.tree.leaves(inputs), iter(kept)
    fresh = jax.tree.leaves(again()) if AGAIN in self.source else None
    weights = iter(self.weights(*inputs[:2]) if self.weights else ())
    leaves = [next(kept) if k is None else fresh[n] if k == AGAIN
              else next(weights) if k == WEIGHTS else given[k]
              for n, k in enumerate(self.source)]
    return jax.tree.unflatten(self.tree, leaves)


def _sources(leaves, inputs) -> tuple:
  where = {id(a): k for k, a in enumerate(jax.tree.leaves(inputs))}
  return tuple(where.get(id(a)) for a in leaves)


def layout(fn: Callable, recompute, chunk, consts, x, i, axes) -> Layout:
  """`fn(chunk, consts, x, i)`'s vjp structure, traced once on these
  (abstract) values; `axes`: those the buffers vary over."""
  found = {}

  def probe(chunk, consts, x, i):
    inputs = (chunk, consts, x)
    _, vjp = stage_vjp(lambda w, c, x_: fn(w, c, x_, i), recompute, *inputs)
    leaves, tree = jax.tree.flatten(vjp)
    found["tree"], found["source"] = tree, _sources(leaves, inputs)
    found["narrower"] = [_narrower(a, axes) for a in leaves]
    return [a for a, k in zip(leaves, found["source"]) if k is None]

  closed = jax.make_jaxpr(probe)(chunk, consts, x, i)
  jaxpr = _compat.open_jaxpr(closed)
  n_weights = len(jax.tree.leaves((chunk, consts)))
  marked = [k >= n_weights for k in range(len(jaxpr.invars))]   # x's and i
  from_weights = [not d for d in depends_on(jaxpr, marked)]
  weights = None
  if any(from_weights):
    pruned, used = _compat.dce(closed, from_weights)
    if _compat.open_jaxpr(pruned).effects or any(used[n_weights:]):
      from_weights = [False] * len(from_weights)   # a callback runs once, as written
    else:
      weights = Weights(pruned, tuple(k for k, u in enumerate(used) if u))
  candidates = iter(zip(from_weights, jaxpr.outvars))
  source, kept = [], []
  for k, narrower in zip(found["source"], found["narrower"]):
    if k is not None:
      source.append(k)
      continue
    weight, var = next(candidates)
    source.append(WEIGHTS if weight else AGAIN if narrower else None)
    if source[-1] is None:
      kept.append(jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype))
  return Layout(found["tree"], tuple(source), tuple(kept), recompute, weights)


def _narrower(a, axes) -> bool:
  have = _compat.varying_axes(a)
  return have is not None and not set(axes) <= set(have)
