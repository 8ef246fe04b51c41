"""A small decoder-only transformer in plain jax, its blocks run by `fsdp_scan`.

Parameters: `embed` (vocab, d) and `final_norm` (d,) replicated on every
device; `blocks`, every leaf stacked over the layers and sharded over the
mesh axis along its first dimension after the layer dimension. One block is
pre-norm causal multi-head attention and a GELU MLP.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int
  d: int = 64
  heads: int = 4
  hidden: int = 128
  layers: int = 4
  seq: int = 48


def init(cfg: Config, key) -> dict:
  ks = jax.random.split(key, 6)
  n, d, h = cfg.layers, cfg.d, cfg.hidden
  dense = lambda k, a, b: jax.random.normal(k, (n, a, b)) / np.sqrt(a)
  return {
      "embed": jax.random.normal(ks[0], (cfg.vocab, d)) * 0.1,
      "final_norm": jnp.ones((d,)),
      "blocks": {
          "norm1": jnp.ones((n, d)), "norm2": jnp.ones((n, d)),
          "qkv": dense(ks[1], d, 3 * d), "out": dense(ks[2], d, d) * 0.5,
          "up": dense(ks[3], d, h), "down": dense(ks[4], h, d) * 0.5,
      },
  }


def specs(params: dict, axis: str) -> dict:
  """Blocks sharded over `axis` (first dim after the layer dim); rest replicated."""
  return {"embed": P(), "final_norm": P(),
          "blocks": jax.tree.map(lambda p: P(None, axis, *[None] * (p.ndim - 2)),
                                 params["blocks"])}


def _norm(x, scale):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def block(cfg: Config):
  """`block(w, x) -> x` for one layer's (gathered) weights `w`: the
  parameters first, as `fsdp_scan(..., params_first=True)` and
  `pipeline_loss` call it."""
  def apply(w, x):
    b, s, d = x.shape
    hd = d // cfg.heads
    q, k, v = jnp.split(_norm(x, w["norm1"]) @ w["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(b, s, cfg.heads, hd)
    logits = jnp.einsum("bqhe,bkhe->bhqk", heads(q), heads(k)) / float(np.sqrt(hd))
    causal = jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    mixed = jnp.einsum("bhqk,bkhe->bqhe", att, heads(v)).reshape(b, s, d)
    x = x + mixed @ w["out"]
    return x + jax.nn.gelu(_norm(x, w["norm2"]) @ w["up"]) @ w["down"]
  return apply


def embed(params: dict, tokens):
  """What runs before the stack: the token embedding."""
  return params["embed"][tokens]


def head(params: dict, x):
  """What runs after it: the final norm and the (tied) output projection."""
  return _norm(x, params["final_norm"]) @ params["embed"].T


def logits(cfg: Config, params: dict, tokens, run_blocks):
  """Token logits; `run_blocks(block, x, blocks) -> x` runs the stack
  (`block(w, x)`, one layer's weights first)."""
  x = run_blocks(block(cfg), embed(params, tokens), params["blocks"])
  return head(params, x)


def cross_entropy(logits_, targets):
  logp = jax.nn.log_softmax(logits_, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
