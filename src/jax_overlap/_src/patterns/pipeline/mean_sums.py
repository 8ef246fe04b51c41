"""The stage weights' gradient sums over `pipeline_loss(mean_axes=)`'s axes,
started as futures when the schedule's ticks end (`start`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_overlap._src.collectives import tpu_forms as _tpu_forms
from jax_overlap._src.collectives.api import psum_start
from jax_overlap._src.patterns import varying as _varying
from jax_overlap._src.patterns.leaf_scope import moving
from jax_overlap._src.patterns.pipeline.tick_names import sum_label
from jax_overlap._src.patterns.pipeline.work import float_leaves


def start(grads, params, mean_axes):
  """Starts the sums of the gradient parts `grads` of the float leaves of
  `params` over those of `mean_axes` each leaf does not vary over (a weight
  replicated over a data-parallel axis); returns a function finishing them,
  which gives the summed parts. Started once the ticks end, before
  `pipeline_loss`'s backward rule scales the parts by the loss's cotangent
  (invariant over `mean_axes`, so the scaling commutes with the sum), so the
  sums run beside what is left to compute.

  One `psum_start` future a leaf, each free to start as soon as its leaf is
  final. Where `psum_start` takes its TPU form (quirks row
  "tpu-collective-forms"), whose all-to-all the compiler keeps one in flight
  at a time (another started beside it runs synchronously), the leaves
  summed over one axis share one future a dtype (their parts flattened and
  joined), and a sum over several axes, which has no TPU form, is the
  `psum` autodiff made. Pinned by
  tests/patterns/pipeline/pipeline_mean_axes_test.py (the futures) and
  tests/aot/llama_4d_compiled_test.py ("DP gradient sums": H100 one future
  a leaf, v5e one joined)."""
  join = _tpu_forms.wanted("psum")
  groups: dict = {}
  for k, like in enumerate(float_leaves(params)):
    over = tuple(a for a in mean_axes if a not in _varying.varying(like))
    if over:
      key = (over, grads[k].dtype) if join else k
      groups.setdefault(key, (over, []))[1].append(k)
  out = list(grads)
  started = []
  with moving(sum_label("the gradient of stage_params")):
    for over, ks in groups.values():
      if join and len(over) > 1:
        for k in ks:
          out[k] = jax.lax.psum(grads[k], over)
        continue
      flat = (grads[ks[0]] if len(ks) == 1 else
              jnp.concatenate([grads[k].reshape(-1) for k in ks]))
      started.append((ks, psum_start(flat, over if len(over) > 1 else over[0])))

  def finish():
    for ks, future in started:
      flat, at = future.done(), 0
      if len(ks) == 1:
        out[ks[0]] = flat
        continue
      for k in ks:
        out[k] = flat[at:at + grads[k].size].reshape(grads[k].shape)
        at += grads[k].size
    return out
  return finish
