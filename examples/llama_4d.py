"""Train a Llama-style decoder on a 4-D mesh: pipeline x FSDP x tensor,
context or expert parallelism, on 8 virtual CPU devices.

The model (plain jax pytrees): a token embedding, blocks of RMSNorm, GQA
attention with RoPE and a SwiGLU MLP (or, with `experts`, a mixture of SwiGLU
experts), a final RMSNorm and an LM head wider than the model (vocab > width).
`loss(params, tokens, targets)` is the model as one program; a `Plan` runs the
same parameters inside one `jax.shard_map` over a mesh whose axes say how:

- `pp`: the blocks cut into stages, `pipeline_loss` runs them (1F1B), the
  embedding before stage 0 (`before=`), the final norm, the head and the loss
  after the last stage (`loss_fn` closes over their weights);
- `fsdp`: each stage's blocks through `fsdp_scan`, every weight sharded over
  the model width, gathered a layer ahead; or `dp`: the weights replicated;
  either way the batch is split over it and the loss `pmean`ed over it (with
  `dp` by `pipeline_loss(..., mean_axes=)`, which then starts the weights'
  gradient sums over `dp` when its ticks end);
- `tp` (tensor parallel): heads and the MLP's hidden units split; with
  `tensor="collective"` the activations are split along the sequence and each
  block's projections are `all_gather_matmul` / `matmul_reduce_scatter` rings
  (Megatron's sequence parallelism, the communication hidden behind the
  matmuls); with `tensor="psum"` the activations are whole and each block ends
  in a sum (Megatron's first form): in a pipeline stage the sequence cut in 2
  chunks streamed through the stage's blocks (`chunked_stream`: each sum a
  `psum_start(..., to="varying")` future in flight behind the other chunk's
  work, forward and backward), without `pp` `matmul_psum` in chunks;
- `cp` (context parallel): the sequence split in the zigzag layout, attention
  by `ring_attention` (causal);
- `ep` (expert parallel): the experts spread over it, each token sent to its
  experts' devices and back; the batch is split over it too. In a pipeline
  stage each block's sequence is cut in 2 chunks streamed through
  `expert_stream` (`moe_stream`: chunk 0's dispatch in flight behind chunk
  1's attention, the other exchanges behind the other chunk's experts,
  forward and backward), without `pp` one `expert_parallel` call in 2 chunks.

`PLANS` holds the four 8-device plans the tests check (tests/patterns/
pipeline/llama_4d_test.py): each gives `loss`'s value and every parameter's
gradient, and the same parameters after a few optax steps.

  python examples/llama_4d.py [--plan pp_fsdp_tp] [--steps 20]
  python examples/llama_4d.py --mesh pp=2,fsdp=2,cp=2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402


# --- the model ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  d: int = 32            # model width
  heads: int = 4
  kv_heads: int = 2      # grouped-query attention: 2 query heads a key/value head
  head_dim: int = 8
  hidden: int = 64       # the SwiGLU MLP's (each expert's) hidden units
  layers: int = 4
  experts: int = 0       # 0: a SwiGLU MLP a block; else a mixture of this many


TOP_K = 2                # experts a token


#: Each leaf's dimensions by name: a plan maps names to mesh axes. Every
#: block leaf is stacked over the layers ("layer").
DIMS = {
    "embed": ("vocab", "model"), "final_norm": ("model",), "head": ("model", "vocab"),
    "attn_norm": ("layer", "model"), "mlp_norm": ("layer", "model"),
    "wq": ("layer", "model", "heads", None), "wk": ("layer", "model", "kv_heads", None),
    "wv": ("layer", "model", "kv_heads", None), "wo": ("layer", "heads", None, "model"),
    "w_gate": ("layer", "model", "hidden"), "w_up": ("layer", "model", "hidden"),
    "w_down": ("layer", "hidden", "model"),
}
EXPERT_DIMS = {
    "router": ("layer", "model", None),
    "w_gate": ("layer", "expert", "model", None), "w_up": ("layer", "expert", "model", None),
    "w_down": ("layer", "expert", None, "model"),
}


def dims_of(blocks: dict, name: str) -> tuple:
  """The dimension names of block leaf `name` (a mixture of experts' own)."""
  return EXPERT_DIMS[name] if "router" in blocks and name in EXPERT_DIMS else DIMS[name]


def init(cfg: Config, key) -> dict:
  """{"embed", "blocks": {leaf: [layers, ...]}, "final_norm", "head"}."""
  ks = iter(jax.random.split(key, 16))
  n, d, f = cfg.layers, cfg.d, cfg.hidden
  normal = lambda shape, fan_in: jax.random.normal(next(ks), shape) / np.sqrt(fan_in)
  # norm scales near 1, not at it: their gradients are then checked too
  scale = lambda shape: 1.0 + 0.1 * jax.random.normal(next(ks), shape)
  blocks = {
      "attn_norm": scale((n, d)), "mlp_norm": scale((n, d)),
      "wq": normal((n, d, cfg.heads, cfg.head_dim), d),
      "wk": normal((n, d, cfg.kv_heads, cfg.head_dim), d),
      "wv": normal((n, d, cfg.kv_heads, cfg.head_dim), d),
      "wo": normal((n, cfg.heads, cfg.head_dim, d), cfg.heads * cfg.head_dim),
  }
  if cfg.experts:
    e = cfg.experts
    blocks.update(router=normal((n, d, e), d), w_gate=normal((n, e, d, f), d),
                  w_up=normal((n, e, d, f), d), w_down=normal((n, e, f, d), f))
  else:
    blocks.update(w_gate=normal((n, d, f), d), w_up=normal((n, d, f), d),
                  w_down=normal((n, f, d), f))
  return {"embed": normal((cfg.vocab, d), 1) * 0.5, "blocks": blocks,
          "final_norm": scale((d,)), "head": normal((d, cfg.vocab), d)}


def rms_norm(x, scale):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def rope(x, positions):
  """Rotary embedding of x [b, s, heads, head_dim] at `positions` [s]."""
  half = x.shape[-1] // 2
  angles = positions[:, None] * (10000.0 ** (-jnp.arange(half) / half))
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def dense_attention(q, k, v, positions, key_positions=None):
  """Causal GQA: q [b, s, heads, hd] at `positions`, k, v [b, t, kv, hd] at
  `key_positions` (default: the same, the whole sequence)."""
  key_positions = positions if key_positions is None else key_positions
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  causal = positions[:, None] >= key_positions[None, :]
  logits = jnp.where(causal, logits, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


def swiglu(h, w_gate_up, w_down, column, row):
  gate, up = jnp.split(column(h, w_gate_up), 2, axis=-1)
  return row(jax.nn.silu(gate) * up, w_down)


def expert(w, tokens):
  """One SwiGLU expert on the tokens routed to it: [C, d] -> [C, d]."""
  return (jax.nn.silu(tokens @ w["w_gate"]) * (tokens @ w["w_up"])) @ w["w_down"]


def route(h, router):
  """Top-k of a softmax router, renormalised: (ids [T, k], weights [T, k])."""
  weights, ids = lax.top_k(jax.nn.softmax(h @ router, -1), TOP_K)
  return ids, weights / weights.sum(-1, keepdims=True)


def dense_experts(h, w):
  """Every expert on every token, combined by the router: the reference."""
  ids, weights = route(h, w["router"])
  out = jax.vmap(expert, (0, None))(
      {k: w[k] for k in ("w_gate", "w_up", "w_down")}, h)     # [E, T, d]
  picked = jnp.take_along_axis(out, ids.T[:, :, None], axis=0)  # [k, T, d]
  return jnp.einsum("tk,ktd->td", weights, picked)


@dataclasses.dataclass(frozen=True)
class Parallel:
  """How a block's parts run: the single program's `Parallel()`, or a plan's."""
  column: Callable = lambda h, w: h @ w          # [..., d] -> [..., n]
  row: Callable = lambda a, w: a @ w             # [..., n] -> [..., d]
  attend: Callable = dense_attention             # (q, k, v, positions) -> out
  positions: Callable = lambda s: jnp.arange(s, dtype=jnp.float32)
  moe: Callable | None = None                    # (h [T, d], w) -> [T, d]


def qkv_of(x, w, column):
  """q, k, v [b, s, heads or kv_heads, head_dim] of x's normed tokens, in one
  projection (one ring under tensor="collective")."""
  b, head_dim = x.shape[0], w["wq"].shape[-1]
  h = rms_norm(x, w["attn_norm"])
  flat = lambda a: a.reshape(a.shape[0], -1)
  qkv = column(h, jnp.concatenate([flat(w[n]) for n in ("wq", "wk", "wv")], -1))
  s = qkv.shape[1]                    # the whole sequence under tensor="collective"
  heads, kv = w["wq"].shape[1], w["wk"].shape[1]
  return jnp.split(qkv.reshape(b, s, heads + 2 * kv, head_dim),
                   [heads, heads + kv], axis=2)


def gate_up_of(w):
  return jnp.concatenate([w["w_gate"], w["w_up"]], -1)


def block(x, w, par: Parallel = Parallel()):
  """One decoder block on x [b, s, d] (a plan's local part of it)."""
  b, d = x.shape[0], x.shape[-1]
  q, k, v = qkv_of(x, w, par.column)
  s = q.shape[1]
  pos = par.positions(s)
  o = par.attend(rope(q, pos), rope(k, pos), v, pos)
  x = x + par.row(o.reshape(b, s, -1), w["wo"].reshape(-1, d))
  h = rms_norm(x, w["mlp_norm"])
  if "router" in w:
    return x + (par.moe or dense_experts)(h.reshape(-1, d), w).reshape(x.shape)
  return x + swiglu(h, gate_up_of(w), w["w_down"], par.column, par.row)


def chunk_attention(x, w, keys, values, lo: int, hi: int):
  """The attention of a sequence chunk x [b, hi - lo, d] (positions lo..hi)
  over the chunks before it (`keys`, `values`: theirs, keys rotated) and
  itself, projected by `wo` (before any sum over a tensor axis); returns it
  with the chunk's rotated keys and values."""
  b, d = x.shape[0], x.shape[-1]
  positions = jnp.arange(hi, dtype=jnp.float32)
  q, k, v = qkv_of(x, w, lambda h, m: h @ m)
  k = rope(k, positions[lo:])
  o = dense_attention(rope(q, positions[lo:]), jnp.concatenate(keys + [k], 1),
                      jnp.concatenate(values + [v], 1), positions[lo:], positions)
  return o.reshape(b, hi - lo, -1) @ w["wo"].reshape(-1, d), k, v


def chunked_stream(x, w, axis, chunks: int = 2):
  """The blocks `w` ([layers, ...], heads and hidden units split over
  `axis`) on x [b, s, d] as `block` (tensor="psum") computes them, with the
  sequence cut into `chunks` (NVIDIA's Domino): each projection's sum over
  `axis` a `psum_start` future typed varying, in flight while the next
  chunk's part (its attention or MLP) runs, in that order
  (`program_order`). Chunk c's attention needs chunks 0..c's keys and
  values only. The backward mirrors it: each sum's transpose is a future
  too, in flight behind the backward of the part written after it. One sum
  in flight at a time (TPU's forms allow one all-to-all); the stream's last
  sum has nothing after it. Each part's compute is a free block
  (`program_order(enforce=False)`), so XLA fuses inside it as in `block`:
  ordered op by op, the stage's step took 2x the plain block's on a TPU v5e
  (docs/pipeline.md, "Composing the axes")."""
  b, s, d = x.shape
  layers = jax.tree.leaves(w)[0].shape[0]
  bounds = [s * c // chunks for c in range(chunks + 1)]
  free = lambda fn: jax_overlap.program_order(enforce=False)(fn)()

  def attention(x, wl, keys, values, c):
    return chunk_attention(x, wl, keys, values, bounds[c], bounds[c + 1])

  def mlp(x, wl):
    gate, up = jnp.split(rms_norm(x, wl["mlp_norm"]) @ gate_up_of(wl), 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ wl["w_down"]

  @jax_overlap.program_order(enforce=True)
  def run(w, x):
    xs = [x[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    pending = []      # [(chunk, its residual, the future of its sum)]

    def step(c, partial):
      """Start chunk c's sum after finishing the one in flight."""
      settle()
      pending.append((c, xs[c], jax_overlap.psum_start(partial, axis, to="varying")))

    def settle():
      if pending:
        c, residual, future = pending.pop()
        xs[c] = residual + future.done()

    def chunk(c):
      """Chunk c's residual, its sum finished first if still in flight
      (one chunk: nothing to write in its window)."""
      if pending and pending[-1][0] == c:
        settle()
      return xs[c]

    for layer in range(layers):
      # the layer's weights sliced inside each free block (fused into its use,
      # not a fenced copy)
      wl = lambda i=layer: jax.tree.map(lambda a: a[i], w)
      keys, values = [], []
      for c in range(chunks):
        x_c = chunk(c)
        partial, k, v = free(lambda c=c, x_c=x_c, ks=tuple(keys), vs=tuple(values), wl=wl:
                             attention(x_c, wl(), list(ks), list(vs), c))
        keys.append(k)
        values.append(v)
        step(c, partial)
      for c in range(chunks):
        x_c = chunk(c)
        step(c, free(lambda x_c=x_c, wl=wl: mlp(x_c, wl())))
    settle()
    return jnp.concatenate(xs, 1)
  return run(w, x)


def moe_stream(x, w, axis, chunks: int = 2):
  """One mixture-of-experts block (`w` a layer's leaves, the experts split
  over `axis`) on x [b, s, d] as `block` computes it, with the sequence cut
  into `chunks` streamed through `jax_overlap.expert_stream`: chunk c's
  dispatch in flight while chunk c+1's attention runs, each later exchange
  beside the other chunk's experts, in that order (`program_order`); the
  backward mirrors it. Only the last chunk's combine has nothing beside it
  (the next layer is fsdp_scan's next step). Chunk c's attention needs
  chunks 0..c's keys and values only; each chunk's tokens are a group of
  their own, capacity its token count (an expert takes a token at most
  once, so none drops). Each chunk's attention is a free block, as in
  `chunked_stream`."""
  b, s, d = x.shape
  bounds = [s * c // chunks for c in range(chunks + 1)]

  @jax_overlap.program_order(enforce=True)
  def run(w, x):
    xs = [x[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    experts = {k: w[k] for k in ("w_gate", "w_up", "w_down")}
    stream = jax_overlap.expert_stream(expert, experts, axis=axis,
                                       capacity=b * (bounds[1] - bounds[0]))
    keys, values = [], []

    def attention(c, x, keys, values):
      """Chunk c's residual after its attention, its normed tokens, their
      routing, its rotated keys and values (a free block: XLA fuses in it)."""
      o, k, v = chunk_attention(x, w, keys, values, bounds[c], bounds[c + 1])
      x = x + o
      h = rms_norm(x, w["mlp_norm"]).reshape(-1, d)
      return x, h, route(h, w["router"]), k, v

    for c in range(chunks):
      xs[c], h, routed, k, v = jax_overlap.program_order(enforce=False)(
          lambda c=c, x=xs[c], ks=tuple(keys), vs=tuple(values):
          attention(c, x, list(ks), list(vs)))()
      keys.append(k)
      values.append(v)
      stream.send(h, *routed)
    outs = stream.close()
    return jnp.concatenate([xc + out.done()[0].reshape(xc.shape)
                            for xc, out in zip(xs, outs)], 1)
  return run(w, x)


def embed(params, tokens):
  return params["embed"][tokens]


def head_loss(params, y, targets):
  """The final norm, the LM head and the mean cross entropy of y's tokens."""
  logits = rms_norm(y, params["final_norm"]) @ params["head"]
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss(params, tokens, targets):
  """The model as one program: the mean next-token loss of tokens [B, S]."""
  x = lax.scan(lambda x, w: (block(x, w), None),
               embed(params, tokens), params["blocks"])[0]
  return head_loss(params, x, targets)


def _varying_joined(leaves: dict, axes: tuple) -> dict:
  """`leaves` (one dtype, invariant over `axes`) joined in one buffer, cast
  to vary over `axes` by one `jax_overlap.pvary_start` future (its
  gradient's sum one future), and cut apart again."""
  flat = jnp.concatenate([a.reshape(-1) for a in leaves.values()])
  flat = jax_overlap.pvary_start(flat, axes).done()
  out, at = {}, 0
  for k, a in leaves.items():
    out[k] = flat[at:at + a.size].reshape(a.shape)
    at += a.size
  return out


# --- the plans ----------------------------------------------------------------------

DATA_AXES = ("fsdp", "dp")
#: the blocks' norm scales (replicated over every axis but 'pp' and 'fsdp')
NORMS = ("attn_norm", "mlp_norm")
#: the leaves replicated over every axis (outside the pipeline's stages)
REPLICATED = ("embed", "final_norm", "head")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How `loss` runs on a mesh (its axes: see the module's docstring).

  `stage(params)` lays the model's parameters out for the plan (the blocks
  cut into [pp, layers / pp, ...]), `unstage` puts a tree of that layout
  (gradients, parameters after training) back; `specs` is its in_specs;
  `loss(staged, tokens, targets)` equals `loss(params, tokens, targets)`.
  """
  axes: dict            # mesh axis -> size, in mesh order
  tensor: str = "collective"
  microbatches: int = 2
  schedule: str = "1f1b"
  devices: tuple | None = None   # default: the first of jax.devices()

  def __post_init__(self):
    names = set(self.axes)
    unknown = names - {"pp", "tp", "cp", "ep", *DATA_AXES}
    if unknown or len(names & set(DATA_AXES)) > 1 or len(names & {"tp", "cp", "ep"}) > 1:
      raise ValueError(
          f"Plan(axes={self.axes}): the axes are 'pp', one of 'fsdp' / 'dp' and one "
          "of 'tp' / 'cp' / 'ep', each at most once")
    if self.tensor not in ("collective", "psum"):
      raise ValueError(f"Plan(tensor={self.tensor!r}): 'collective' or 'psum'")

  @property
  def mesh(self):
    shape = tuple(self.axes.values())
    devices = self.devices or jax.devices()[:int(np.prod(shape))]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), tuple(self.axes),
                             axis_types=(jax.sharding.AxisType.Auto,) * len(shape))

  @property
  def stages(self) -> int:
    return self.axes.get("pp", 1)

  @property
  def data(self) -> str | None:
    return next((a for a in DATA_AXES if a in self.axes), None)

  def _rules(self) -> dict:
    """Dimension name -> mesh axis."""
    rules = {}
    if "fsdp" in self.axes:
      rules["model"] = "fsdp"
    if "tp" in self.axes:
      rules.update(heads="tp", kv_heads="tp", hidden="tp")
    if "ep" in self.axes:
      rules["expert"] = "ep"
    return rules

  def specs(self, params) -> dict:
    rules = self._rules()
    out = {k: P() for k in ("embed", "final_norm", "head")}
    def spec(*axes):    # trailing Nones dropped: the spec jit gives its outputs
      axes = list(axes)
      while axes and axes[-1] is None:
        axes.pop()
      return P(*axes)
    out["blocks"] = {k: spec("pp" if "pp" in self.axes else None,
                             *[rules.get(n) for n in dims_of(params["blocks"], k)])
                     for k in params["blocks"]}
    return out

  def batch_spec(self) -> P:
    """tokens [B, S]: B over the data and expert axes, S over the context
    axis, or over the tensor axis under tensor="collective"."""
    rows = tuple(a for a in (self.data, "ep") if a in self.axes)
    seq = "cp" if "cp" in self.axes else (
        "tp" if "tp" in self.axes and self.tensor == "collective" else None)
    return P(rows or None, seq)

  def _shard_dims(self, blocks) -> dict:
    """fsdp_scan's shard_dims: where each stage leaf [layers/pp, ...] is
    split over 'fsdp' (its "model" dimension)."""
    return {k: dims_of(blocks, k).index("model") for k in blocks}

  def stage(self, params) -> dict:
    p = self.stages
    return dict(params, blocks=jax.tree.map(
        lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), params["blocks"]))

  def unstage(self, tree) -> dict:
    return dict(tree, blocks=jax.tree.map(
        lambda a: a.reshape((-1,) + a.shape[2:]), tree["blocks"]))

  def place(self, params) -> dict:
    """`stage(params)` put on the mesh as `specs` says."""
    mesh = self.mesh
    staged = self.stage(params)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        staged, self.specs(params))

  def parallel(self) -> Parallel:
    """The block's parts inside the shard_map."""
    kw = {}
    if "tp" in self.axes and self.tensor == "collective":
      kw.update(column=lambda h, w: jax_overlap.all_gather_matmul(
                    h, w, "tp", gather_dimension=1),
                row=lambda a, w: jax_overlap.matmul_reduce_scatter(
                    a, w, "tp", scatter_dimension=1))
    elif "tp" in self.axes:
      # psum(a @ w) with the rows in 2 chunks, each chunk's sum in flight
      # behind the next chunk's matmul (with `pp` a stage is
      # `chunked_stream` instead: see _body).
      kw.update(row=lambda a, w: jax_overlap.matmul_psum(
          a, w, "tp", chunks=2, dimension=1))
    if "cp" in self.axes:
      cp = self.axes["cp"]

      def positions(s):   # this device's chunks of the zigzag layout
        every = jax_overlap.to_layout(jnp.arange(s * cp, dtype=jnp.float32),
                                      "zigzag", cp, seq_axis=0)
        return lax.dynamic_slice_in_dim(every, lax.axis_index("cp") * s, s)
      kw.update(positions=positions,
                attend=lambda q, k, v, pos: jax_overlap.ring_attention(
                    q, k, v, axis="cp", causal=True, layout="zigzag"))
    if "ep" in self.axes:
      def moe(h, w):
        ids, weights = route(h, w["router"])
        experts = {k: w[k] for k in ("w_gate", "w_up", "w_down")}
        # capacity = the tokens: an expert takes each token at most once, so none drops
        y, _ = jax_overlap.expert_parallel(expert, h, ids, weights, experts, axis="ep",
                                           capacity=h.shape[0], chunks=2)
        return y
      kw["moe"] = moe
    return Parallel(**kw)

  def loss(self, staged, tokens, targets):
    """`loss(params, tokens, targets)` of `stage(params)` on the mesh."""
    if "cp" in self.axes:   # each device's chunks of the sequence, zigzag
      tokens, targets = (jax_overlap.to_layout(a, "zigzag", self.axes["cp"])
                         for a in (tokens, targets))
    batch = self.batch_spec()
    return jax.shard_map(self._body, mesh=self.mesh,
                         in_specs=(self.specs(staged), batch, batch),
                         out_specs=P())(staged, tokens, targets)

  def _varying(self, params) -> dict:
    """`params` with the leaves replicated over a mesh axis cast to vary
    over it by `pvary_start` futures, so that their gradients' sums are
    futures (on TPU one a mesh axis, each in its async form there) instead
    of the psums autodiff runs whole after pipeline_loss's backward
    (synchronous on TPU): the embedding, final norm and head (replicated
    over every axis), joined in one buffer; without 'fsdp', the blocks'
    norm scales (replicated over every axis but 'pp'), joined in another.
    With 'fsdp' on the TPU v5e, fsdp_scan's reduce-scatter futures hold the
    one all-to-all slot at the backward's end, and the norm scales' future
    there ran synchronous, with FSDP gathers and reduce-scatters (measured
    with tests/aot/llama_4d_compiled_test.py): with 'tp' pipeline_loss's
    `mean_axes` sums them as its ticks end instead (see `_body`).
    (Inside a stage no sum can start: pipeline_loss casts every stage
    weight to vary over every axis.)"""
    blocks = params["blocks"]
    norms_over = tuple(a for a in self.axes if a != "pp")
    top = _varying_joined({k: params[k] for k in REPLICATED}, tuple(self.axes))
    if norms_over and "fsdp" not in self.axes:
      blocks = dict(blocks, **_varying_joined(
          {k: blocks[k] for k in NORMS}, norms_over))
    return dict(params, blocks=blocks, **top)

  def _body(self, params, tokens, targets):
    if "pp" in self.axes:
      params = self._varying(params)
    par = self.parallel()
    layer = lambda w, x: block(x, w, par)     # the params first, as fsdp_scan's
    blocks = params["blocks"]

    def stage(w, x):    # w: this stage's blocks, [layers / pp, ...] (local parts)
      if self.tensor == "psum" and "tp" in self.axes and "pp" in self.axes:
        # The residual stream varies over 'tp' in a stage (pipeline_loss's
        # activations vary over every input axis), so each sum is typed
        # varying, and its gradient's sum is a future of the stream's too.
        return chunked_stream(x, w, "tp")
      step = layer
      if "ep" in self.axes and "pp" in self.axes:
        # each block's tokens in 2 sequence chunks through an expert_stream:
        # its exchanges in flight behind the other chunk's attention/experts
        step = lambda wl, x: moe_stream(x, wl, "ep")
      if "fsdp" in self.axes:
        return jax_overlap.fsdp_scan(step, x, w, axis="fsdp",
                                     shard_dims=self._shard_dims(w),
                                     params_first=True)
      return lax.scan(lambda x, wi: (step(wi, x), None), x, w)[0]

    last = lambda y, t: head_loss(params, y, t)
    # each device's loss is its tokens' mean: the mean over the devices
    # holding other tokens is the model's. Under tensor="psum" the devices of
    # 'tp' hold the same tokens and loss; pipeline_loss's is typed varying
    # over 'tp' all the same (as every input axis), a plain psum's is not.
    others = tuple(a for a in self.axes if a != "pp" and not (
        a == "tp" and self.tensor == "psum" and "pp" not in self.axes))
    averaged = ()
    if "pp" in self.axes:
      split = lambda a: a.reshape((self.microbatches, -1) + a.shape[1:])
      # With 'dp' (the blocks replicated over it) or 'tp' (the norm scales
      # replicated over it) pipeline_loss takes the mean itself, so each
      # such block weight's sum over 'dp' / 'tp' (those `_varying` did not
      # cast) starts when the ticks end instead of after its backward rule
      # (mean_axes).
      averaged = others if "dp" in self.axes or "tp" in self.axes else ()
      value = jax_overlap.pipeline_loss(
          stage, last, blocks, split(tokens), split(targets), axis="pp",
          schedule=self.schedule, before=lambda t: embed(params, t),
          mean_axes=averaged)
    else:
      value = last(stage(jax.tree.map(lambda a: a[0], blocks),
                         embed(params, tokens)), targets)
    others = tuple(a for a in others if a not in averaged)
    return lax.pmean(value, others) if others else value


def config_for(plan: Plan) -> Config:
  return Config(experts=4 if "ep" in plan.axes else 0)


#: The four 8-device plans (tests/patterns/pipeline/llama_4d_test.py).
PLANS = {
    "pp_fsdp_tp": Plan({"pp": 2, "fsdp": 2, "tp": 2}),
    "pp_fsdp_cp": Plan({"pp": 2, "fsdp": 2, "cp": 2}),
    "pp_dp_tp": Plan({"pp": 2, "dp": 2, "tp": 2}, tensor="psum"),
    "pp_fsdp_ep": Plan({"pp": 2, "fsdp": 2, "ep": 2}),
}


def init_state(plan: Plan, optimizer, params):
  """optimizer.init(params), each moment laid out like its parameter and the
  rest (adam's count) replicated: as the train step returns them, so that its
  second call does not compile again."""
  import optax  # noqa: PLC0415
  everywhere = NamedSharding(plan.mesh, P())
  return optax.tree_utils.tree_map_params(
      optimizer, lambda s, p: jax.device_put(s, p.sharding), optimizer.init(params),
      params, transform_non_params=lambda s: jax.device_put(s, everywhere))


def train_step(plan: Plan, optimizer):
  """jit of (staged params, opt_state, tokens, targets) -> (params, opt_state, loss)."""
  import optax  # noqa: PLC0415

  @jax.jit
  def step(params, opt_state, tokens, targets):
    value, grads = jax.value_and_grad(plan.loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


# --- data and training --------------------------------------------------------------

def batch(cfg: Config, key, rows: int, seq: int):
  """Sequences whose next token is a fixed random function of the token (the
  first random): (tokens, targets), each [rows, seq]."""
  rule = jax.random.permutation(jax.random.key(42), cfg.vocab)
  first = jax.random.randint(key, (rows,), 0, cfg.vocab)
  seqs = lax.scan(lambda t, _: (rule[t], rule[t]), first, None, length=seq)[1].T
  seqs = jnp.concatenate([first[:, None], seqs], 1)
  return seqs[:, :-1], seqs[:, 1:]


def batch_size(plan: Plan, per_device: int = 1) -> int:
  """Rows a step: `per_device` sequences a microbatch on each data/expert device."""
  rows = plan.microbatches * per_device
  for a in (plan.data, "ep"):
    rows *= plan.axes.get(a, 1)
  return rows


def parse_mesh(text: str) -> dict:
  """"pp=2,fsdp=2,tp=2" -> {"pp": 2, "fsdp": 2, "tp": 2}."""
  try:
    return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
  except ValueError:
    raise ValueError(f"--mesh {text!r}: write axis=size pairs, e.g. pp=2,fsdp=2,tp=2") from None


def train(plan: Plan, steps: int, seq: int = 16, seed: int = 0, say=print) -> list:
  """Trains `plan` for `steps` adam steps; returns the losses."""
  import optax  # noqa: PLC0415
  cfg = config_for(plan)
  params = plan.place(init(cfg, jax.random.key(seed)))
  optimizer = optax.adam(3e-3)
  step = train_step(plan, optimizer)
  opt_state = init_state(plan, optimizer, params)
  sharding = NamedSharding(plan.mesh, plan.batch_spec())
  key = jax.random.key(seed + 1)
  losses = []
  t0 = time.perf_counter()
  for i in range(steps):
    key, sub = jax.random.split(key)
    tokens, targets = (jax.device_put(a, sharding)
                       for a in batch(cfg, sub, batch_size(plan), seq))
    params, opt_state, value = step(params, opt_state, tokens, targets)
    losses.append(float(value))
    if i == 0 or (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
      say(f"step {i + 1:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
  return losses


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--plan", choices=sorted(PLANS), default="pp_fsdp_tp")
  parser.add_argument("--mesh", default=None,
                      help="axis=size pairs instead of --plan, e.g. pp=2,fsdp=2,cp=2")
  parser.add_argument("--tensor", choices=("collective", "psum"), default="collective")
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  plan = (Plan(parse_mesh(args.mesh), tensor=args.tensor) if args.mesh
          else PLANS[args.plan])
  jax.config.update("jax_num_cpu_devices", int(np.prod(list(plan.axes.values()))))
  print(f"mesh {plan.axes}, tensor parallelism by {plan.tensor}, "
        f"{plan.microbatches} microbatches, schedule {plan.schedule}")
  losses = train(plan, args.steps)
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")


if __name__ == "__main__":
  main()
