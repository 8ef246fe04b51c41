"""Which code computes a block of attention: XLA's operations (kernel.py) or
the Pallas TPU flash kernel (flash_tpu.py).

`implementation` (an argument of `ring_attention` and `ulysses_attention`,
named as `jax.nn.dot_product_attention` names its own):
* None: the kernel where the program is compiled for TPU and the block fits
  it (`flash_tpu.fits_tpu`: head_dim and both lengths multiples of 128),
  XLA's operations elsewhere (CPU, GPU) and for blocks that do not fit;
* "xla": XLA's operations everywhere;
* "pallas": the kernel; on CPU it runs in Pallas's interpreter (slow: for
  tests; inside `jax.shard_map(..., check_vma=False)` only, see
  `_compat.PALLAS_INTERPRET`). A GPU refuses it.

The platform is the mesh's where the trace knows it (inside `shard_map`);
elsewhere `jax.lax.platform_dependent` leaves the choice to the lowering, so
that a program compiled ahead of time for TPU on a CPU host gets the kernel.
A jax without the Pallas TPU API the kernel uses runs XLA's operations,
warned once.

Both give the same contract (kernel.py's): `block_forward` updates the online
softmax's `Stats` with a block of keys, `block_backward` gives the block's
part of (dq, dk, dv) in float32 from the whole attention's lse and delta;
`choose` picks between any two such codes (local.py's whole attention on one
device). Pinned by tests/patterns/attention/flash_tpu_test.py.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jax_overlap._src import _compat
from jax_overlap._src.patterns.attention import flash_tpu
from jax_overlap._src.patterns.attention import kernel

IMPLEMENTATIONS = ("xla", "pallas")
_GPUS = ("gpu", "cuda", "rocm")
_warned: set[str] = set()


def check(name: str, implementation):
  """`implementation`, checked where the user gives it."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{name}(implementation={implementation!r}): give None (the Pallas TPU "
        "flash kernel on TPU, XLA elsewhere), 'xla' or 'pallas'.")
  if implementation == "pallas" and jax.default_backend() in _GPUS:
    raise ValueError(
        f"{name}(implementation='pallas') runs a Pallas TPU kernel, and this "
        f"process's backend is {jax.default_backend()!r}; leave implementation "
        "None (XLA's operations off TPU) or give 'xla'.")
  return implementation


def _warn_once(key: str, message: str):
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, stacklevel=4)


def _platform() -> str | None:
  platform, _ = _compat.trace_device()
  return platform


def choose(implementation, q, k, v, kernel_fn, xla_fn, *args):
  """`kernel_fn(interpret)(*args)` or `xla_fn(*args)`, as `implementation`
  and the platform say, for queries q against keys k and values v
  (sequence on axis 1, head_dim last)."""
  fits = _fits(q, k, v)
  if implementation == "xla":
    return xla_fn(*args)
  platform = _platform()
  if implementation is None and (not fits or platform not in (None, "tpu")):
    return xla_fn(*args)   # (Pallas not even imported)
  missing = _compat.pallas_tpu_missing()
  if missing is not None:
    if (implementation == "pallas" or platform == "tpu"
        or jax.default_backend() == "tpu"):
      _warn_once("missing", (
          f"jax {jax.__version__} lacks {missing}, which jax_overlap's Pallas "
          "TPU flash kernel uses; attention runs on XLA's operations instead."))
    return xla_fn(*args)
  if implementation is None:
    if platform == "tpu":
      return kernel_fn(False)(*args)
    return jax.lax.platform_dependent(*args, tpu=kernel_fn(False),
                                      default=xla_fn)
  # implementation == "pallas"
  if platform in _GPUS:
    raise ValueError(
        "implementation='pallas' runs a Pallas TPU kernel, and this mesh's "
        f"devices are {platform!r}; leave implementation None or give 'xla'.")
  if not fits and (platform == "tpu" or jax.default_backend() == "tpu"):
    raise ValueError(
        f"implementation='pallas': the TPU kernel needs head_dim and the "
        f"lengths of a block's queries and keys to be multiples of "
        f"{flash_tpu.LANES} in bfloat16 or float32; this block is {_what(q, k)}. "
        "Leave implementation None to run such blocks on XLA's operations.")
  if platform is not None and platform != "tpu":
    if any(_compat.varying_axes(a) is not None
           for a in jax.tree.leaves(args)):
      raise ValueError(
          f"implementation='pallas' on {platform} runs the TPU kernel in "
          "Pallas's interpreter, which fails inside a jax.shard_map that "
          "checks varying axes; give jax.shard_map(..., check_vma=False), or "
          "leave implementation None (XLA's operations off TPU).")
    return kernel_fn(True)(*args)
  if platform == "tpu":
    return kernel_fn(False)(*args)
  return jax.lax.platform_dependent(*args, tpu=kernel_fn(False),
                                    default=kernel_fn(True))


def _what(q, k) -> str:
  return (f"{q.shape[1]} queries against {k.shape[1]} keys, head_dim "
          f"{q.shape[-1]}, {jnp.dtype(q.dtype).name}")


def _fits(q, k, v) -> bool:
  return (q.dtype == k.dtype == v.dtype
          and flash_tpu.fits_tpu(q.shape[1], k.shape[1], q.shape[-1], q.dtype))


def _positions(q, k, k_offset: int):
  if not k_offset:
    return None
  return jnp.arange(q.shape[1]), k_offset + jnp.arange(k.shape[1])


def merge(stats: kernel.Stats, out, lse) -> kernel.Stats:
  """`stats` updated with a block's normalised output and log-sum-exp (a
  block seen as one key of weight exp(lse) and value out); a row the block
  hid entirely (lse MASKED) keeps its state."""
  seen = lse > kernel._MASKED / 2
  m = jnp.maximum(stats.m, jnp.where(seen, lse, kernel._MASKED))
  fade = jnp.exp(stats.m - m)
  weight = jnp.where(seen, jnp.exp(lse - m), 0.0)
  return kernel.Stats(stats.o * fade[..., None]
                      + out.astype(jnp.float32) * weight[..., None],
                      m, stats.l * fade + weight)


def _given(masking: dict) -> dict:
  return {name: value for name, value in masking.items() if value is not None}


def block_forward(implementation, stats: kernel.Stats, q, k, v, *,
                  causal: bool, scale: float, q_seg=None, k_seg=None,
                  k_offset: int = 0, **masking) -> kernel.Stats:
  """kernel.block_forward's update, by `implementation`; key j at position
  k_offset + j when causal. `masking`: kernel.block_forward's other mask
  arguments (traced `positions`, a sliding `window`); a block given one
  runs on XLA's operations (the kernel's masks are static)."""
  if _given(masking):
    return kernel.block_forward(stats, q, k, v, causal=causal, scale=scale,
                                q_seg=q_seg, k_seg=k_seg, **_given(masking))

  def xla(stats, q, k, v, q_seg, k_seg):
    return kernel.block_forward(stats, q, k, v, causal=causal, scale=scale,
                                q_seg=q_seg, k_seg=k_seg,
                                positions=_positions(q, k, k_offset))

  def pallas(interpret):
    def run(stats, q, k, v, q_seg, k_seg):
      out, lse = flash_tpu.forward(
          q, k, v, mask=flash_tpu.Mask(causal, k_offset), scale=scale,
          q_seg=q_seg, k_seg=k_seg, interpret=interpret)
      return merge(stats, out, lse)
    return run
  return choose(implementation, q, k, v, pallas, xla,
                stats, q, k, v, q_seg, k_seg)


def block_backward(implementation, q, k, v, do, lse, delta, *, causal: bool,
                   scale: float, q_seg=None, k_seg=None, k_offset: int = 0,
                   **masking):
  """kernel.block_backward's (dq, dk, dv), float32, by `implementation`;
  `masking` as block_forward's."""
  if _given(masking):
    return kernel.block_backward(q, k, v, do, lse, delta, causal=causal,
                                 scale=scale, q_seg=q_seg, k_seg=k_seg,
                                 **_given(masking))

  def xla(q, k, v, do, lse, delta, q_seg, k_seg):
    return kernel.block_backward(q, k, v, do, lse, delta, causal=causal,
                                 scale=scale, q_seg=q_seg, k_seg=k_seg,
                                 positions=_positions(q, k, k_offset))

  def pallas(interpret):
    def run(q, k, v, do, lse, delta, q_seg, k_seg):
      return flash_tpu.backward(
          q, k, v, do, lse, delta, mask=flash_tpu.Mask(causal, k_offset),
          scale=scale, q_seg=q_seg, k_seg=k_seg, interpret=interpret)
    return run
  return choose(implementation, q, k, v, pallas, xla,
                q, k, v, do, lse, delta, q_seg, k_seg)
