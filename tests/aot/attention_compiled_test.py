"""ring_attention on the real TPU v5e and H100 compilers, ahead of time, p = 8:
every rotation an async collective-permute with block matmuls between its
start and its done, forward and backward.

One compile a target and setting, of the gradient (it holds the forward
too): causal, GQA (4 heads, 2 kv heads), bfloat16; zigzag, and with a
sliding window (the ring takes fewer steps, some a shift of more than one
device, and masks pairs by global position): contiguous with a window
reaching two devices back, zigzag with one inside a chunk (offsets 0, 1 and
p - 1). Which ring a permute belongs to is read from its metadata, the
`moving` name the library gives it ("k, v" or "dk, dv"). A step whose
devices compute different pairs (some none: a causal or windowed step)
chooses by a `conditional`; its matmuls are in the branch computations, and
a window holding it counts the larger branch's. Skips where libtpu or the
CUDA plugin is absent (compilers.target).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, compiled_text, target

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention.ring import ring_attention

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

SEQ_LOCAL = 256

#: (layout, window, rotations of (k, v) a pass on 8 devices).
SETTINGS = {"zigzag": ("zigzag", None, 7),
            "contiguous-window": ("contiguous", (SEQ_LOCAL + 44, 0), 2),
            "zigzag-window": ("zigzag", (100, 0), 2)}
CASES = [(name, setting) for setting in SETTINGS
         for name in ("gpu_h100", "tpu_v5e")]


@functools.cache
def _windows(name, setting="zigzag"):
  t = target(name)
  layout, window, _ = SETTINGS[setting]
  attend = jax.shard_map(
      lambda q, k, v: ring_attention(q, k, v, axis="x", causal=True,
                                     layout=layout, window=window),
      mesh=t.mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))
  grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  shape = lambda heads: (1, t.n * SEQ_LOCAL, heads, 64)
  args = [arg(t, shape(h), P(None, "x"), jnp.bfloat16) for h in (4, 2, 2)]
  text = compiled_text(grad, *args)
  comps = schedule.scheduled(text)
  every = schedule.computations(text)
  by_leaf = {"k, v": [], "dk, dv": []}
  for w in schedule.windows(text):
    if w.kind != "collective-permute":
      continue
    leaf = re.search(r"jax_overlap\.leaf=([^/\"]*)",
                     comps[w.computation][w.start].line)
    by_leaf[leaf.group(1) if leaf else None] = \
        by_leaf.get(leaf.group(1) if leaf else None, []) + [
            _matmuls(w.between, every)]
  return t.n, by_leaf, schedule.is_sync(text, "collective-permute")


def _matmuls(instrs, every) -> int:
  """The matmuls of `instrs`, with a conditional's larger branch's."""
  count = 0
  for i in instrs:
    count += i.is_matmul
    if i.opcode == "conditional":
      found = re.search(r"branch_computations=\{([^}]*)\}", i.line)
      names = re.findall(r"%([\w.\-]+)", found.group(1)) if found else \
          re.findall(r"(?:true|false)_computation=%([\w.\-]+)", i.line)
      count += max((_matmuls(every[n], every) for n in names), default=0)
  return count


@pytest.mark.parametrize("name,setting", CASES)
def test_kv_rotations_in_flight_over_block_matmuls(name, setting):
  p, by_leaf, sync = _windows(name, setting)
  rotations = SETTINGS[setting][2]
  assert rotations == p - 1 or SETTINGS[setting][1] is not None
  assert not sync
  kv = by_leaf["k, v"]
  # The rotations in the forward pass, again in the backward pass.
  assert len(kv) == 2 * rotations, by_leaf
  assert all(matmuls >= 1 for matmuls in kv), kv


@pytest.mark.parametrize("name,setting", CASES)
def test_gradient_rotations_in_flight_over_block_matmuls(name, setting):
  _, by_leaf, _ = _windows(name, setting)
  grads = by_leaf["dk, dv"]
  assert len(grads) == SETTINGS[setting][2], by_leaf
  # The last hop home too: part of the device's own block is computed
  # behind it (ring._self_parts).
  assert all(matmuls >= 1 for matmuls in grads), grads
  assert set(by_leaf) == {"k, v", "dk, dv"}, by_leaf
