"""A stage's residuals, kept from its forward action to its backward ones.

With `recompute=False` (the default off TPU: `choose_recompute`) the
forward action takes `jax.vjp` of the stage and keeps the residuals the
backward needs; the backward actions
(B, or zero bubble's I and W) apply that vjp without running the stage's
forward again. The function `jax.vjp` returns is a pytree whose leaves are
the residual arrays: its structure is found once by tracing the stage on
the executor's types (`layout`), the leaves that are the stage's own inputs
(its parameters, the closed-over values, the kept stage input) are read
back from where they already live, and only the others take rows of the
executor's buffers: one row a (microbatch, chunk) in flight, the rows the
kept stage inputs use (buffers.py), so the memory stays flat in m. A
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

from jax_overlap._src import _compat

#: A vjp leaf the backward computes again (`Layout.source`).
AGAIN = "again"


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


def choose_recompute(recompute):
  """`recompute` as given; for None, True where the program is for TPU (the
  platform of the mesh being traced over, where jax says; else
  `jax.default_backend()`), False elsewhere. Why: on the v5e compiler the
  pipeline's residual buffers (zero fills, copies, row writes) cost more
  than running the stage's forward again (1F1B bench 51.1 against 33.2 ms
  modelled), though keeping a stage's residuals ran 0.78x recomputing on
  the chip itself; on GPUs keeping them is faster (H100 0.89x).
  docs/pipeline.md, "Memory"; pinned by
  pipeline_residuals_test.py (CPU) and tests/aot/pipeline_compiled_test.py
  (`test_the_default_recomputes_on_tpu_and_keeps_residuals_on_gpu`)."""
  check_recompute(recompute)
  if recompute is not None:
    return recompute
  platform, _ = _compat.trace_device()
  return (platform or jax.default_backend()) == "tpu"


def stage_vjp(fn: Callable, recompute, chunk, consts, x):
  """`(y, vjp)` of `fn(chunk, consts, x)`; the stage under
  `jax.checkpoint(policy=recompute)` where `recompute` is a policy."""
  if callable(recompute):
    fn = jax.checkpoint(fn, policy=recompute)
  return jax.vjp(fn, chunk, consts, x)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The stage vjp's structure: `tree` its treedef; `source[k]` for its
  k-th leaf the index of the stage input leaf (of `(chunk, consts, x)`) it
  is, or None where it is kept in the buffers; `kept` the kept leaves'
  shapes and dtypes."""
  tree: Any
  source: tuple
  kept: tuple
  recompute: Any

  def split(self, vjp, inputs) -> list:
    """The leaves of `vjp` to keep (the forward action's)."""
    leaves, _ = jax.tree.flatten(vjp)
    expected = tuple(None if k == AGAIN else k for k in self.source)
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
    leaves = [next(kept) if k is None else fresh[n] if k == AGAIN else given[k]
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
    source = _sources(leaves, inputs)
    found["tree"] = tree
    found["source"] = tuple(AGAIN if k is None and _narrower(a, axes) else k
                            for a, k in zip(leaves, source))
    return [a for a, k in zip(leaves, found["source"]) if k is None]

  kept = jax.eval_shape(probe, chunk, consts, x, i)
  return Layout(found["tree"], found["source"], tuple(kept), recompute)


def _narrower(a, axes) -> bool:
  have = _compat.varying_axes(a)
  return have is not None and not set(axes) <= set(have)
