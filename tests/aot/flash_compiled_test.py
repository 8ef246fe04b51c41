"""The Pallas TPU flash kernel (patterns/attention/flash_tpu.py) on the real
compilers, ahead of time: the TPU v5e compiler takes its kernels (Mosaic
compiles them here, as it would on a chip), and inside `ring_attention` every
rotation stays an async collective-permute with a kernel between its start
and its done; the H100 compiler gets XLA's operations, as before.

The kernel compiles on every jax (the chip the benchmarks ran on has jax
0.10.2 and libtpu 0.0.42.1, .venv-aot-jax0.10.2's); the windows are read on
the newest jax only (before 0.12 a future's halves lower back to back on
TPU/GPU, tests/aot/attention_compiled_test.py). One compile a case.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import P, arg, compiled_text, target

import jax_overlap
from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention import flash_tpu, kernel
from jax_overlap._src.patterns.attention.ring import ring_attention
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention

pytestmark = pytest.mark.newest_jax(older_jax=["test_the_tpu_compiler_takes_the_kernels"])

KERNEL = 'custom_call_target="tpu_custom_call"'
SEQ_LOCAL = 256   # zigzag chunks of 128: the kernel's tile


@pytest.mark.parametrize("segments", [False, True], ids=["causal", "causal-segments"])
def test_the_tpu_compiler_takes_the_kernels(segments):
  # GQA (4 heads over 2 kv heads), bfloat16, 1,024 rows a device in tiles
  # of 512, forward (one kernel) and backward (dq; dk and dv).
  t = target("tpu_v5e")
  mask = flash_tpu.Mask(True)

  def forward(q, k, v, seg):
    return flash_tpu.forward(kernel.group_heads(q, 2), k, v, mask=mask,
                             scale=0.1, q_seg=seg, k_seg=seg)

  def backward(q, k, v, lse, seg):
    g = kernel.group_heads(q, 2)
    return flash_tpu.backward(g, k, v, g, lse, lse, mask=mask, scale=0.1,
                              q_seg=seg, k_seg=seg)
  n = t.n * 1024
  q = arg(t, (1, n, 4, 128), P(None, "x"), jnp.bfloat16)
  kv = arg(t, (1, n, 2, 128), P(None, "x"), jnp.bfloat16)
  lse = arg(t, (1, n, 2, 2), P(None, "x"), jnp.float32)
  seg = arg(t, (1, n), P(None, "x"), jnp.int32) if segments else None
  smap = lambda f: jax.shard_map(f, mesh=t.mesh, in_specs=P(None, "x"),
                                 out_specs=P(None, "x"))
  assert compiled_text(smap(forward), q, kv, kv, seg).count(KERNEL) == 1
  assert compiled_text(smap(backward), q, kv, kv, lse, seg).count(KERNEL) == 2


@functools.cache
def _ring_windows(name):
  t = target(name)
  attend = jax.shard_map(
      lambda q, k, v: ring_attention(q, k, v, axis="x", causal=True,
                                     layout="zigzag"),
      mesh=t.mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))
  grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  shape = lambda heads: (1, t.n * SEQ_LOCAL, heads, 128)
  text = compiled_text(grad, *[arg(t, shape(h), P(None, "x"), jnp.bfloat16)
                               for h in (4, 2, 2)])
  comps = schedule.scheduled(text)
  by_leaf = {}
  for w in schedule.windows(text):
    if w.kind == "collective-permute":
      leaf = re.search(r"jax_overlap\.leaf=([^/\"]*)",
                       comps[w.computation][w.start].line)
      by_leaf.setdefault(leaf and leaf.group(1), []).append(w)
  return t.n, text, by_leaf


def _kernels(window) -> int:
  return sum(KERNEL in i.line for i in window.between)


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")
def test_ring_rotations_in_flight_with_the_kernel_on_tpu():
  p, text, by_leaf = _ring_windows("tpu_v5e")
  assert not schedule.is_sync(text, "collective-permute")
  assert set(by_leaf) == {"k, v", "dk, dv"}, by_leaf
  kv, grads = by_leaf["k, v"], by_leaf["dk, dv"]
  assert (len(kv), len(grads)) == (2 * (p - 1), p - 1)
  # Each window holds kernels (forward: one a pair; backward: dq and dk, dv
  # a pair), and no block is left to XLA's matmuls.
  assert all(_kernels(w) >= 2 for w in kv + grads), \
      [_kernels(w) for w in kv + grads]
  assert all(w.matmuls == 0 for w in kv + grads), [w.matmuls for w in kv + grads]


@pytest.mark.skipif(not _compat.ASYNC_CUSTOM_CALLS,
                    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")
def test_ring_on_gpu_keeps_xla_operations():
  p, text, by_leaf = _ring_windows("gpu_h100")
  assert KERNEL not in text and "pallas" not in text.lower()
  windows = by_leaf["k, v"] + by_leaf["dk, dv"]
  assert len(windows) == 3 * (p - 1)
  assert all(w.matmuls >= 1 for w in windows), [w.matmuls for w in windows]


def test_ulysses_attends_with_the_kernel_on_tpu():
  t = target("tpu_v5e")
  attend = jax.shard_map(
      lambda q, k, v: ulysses_attention(q, k, v, axis="x", causal=True),
      mesh=t.mesh, in_specs=P(None, "x"), out_specs=P(None, "x"))
  grad = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  args = [arg(t, (1, t.n * 128, h, 128), P(None, "x"), jnp.bfloat16)
          for h in (8, 8, 8)]
  with warnings.catch_warnings():
    # Its all-to-alls compile synchronous on TPU, said by a warning of their
    # own (tests/aot/real_compilers_test.py); here the kernel is the point.
    warnings.simplefilter("ignore", jax_overlap.CollectiveNotAsyncWarning)
    text = compiled_text(grad, *args)
  assert text.count(KERNEL) == 3
