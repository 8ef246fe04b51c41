"""Train a small mixture-of-experts transformer with expert parallelism (`expert_parallel`).

Eight virtual CPU devices, one mesh axis "e". The model is a decoder-only
transformer: token and position embeddings, then blocks of causal
single-head attention and a mixture-of-experts feed-forward layer, each with
a residual and a layer norm, and a tied read-out. Each feed-forward layer has
8 experts (two-layer MLPs), one a device; each token goes to its top 2 by a
softmax router, which is the user's own code below. `expert_parallel` sends
each device's tokens to their experts' devices, runs the experts and brings
the results back, chunked so that one chunk's all-to-alls are in flight
while the experts compute another. Each device holds its own sequences (data
parallel for the attention and the embeddings, whose gradients jax sums
over "e"). optax AdamW trains it.

The task: next-token prediction on sequences where each token is a fixed
random function of the token two before it (the first two random), so the
attention must learn to look two tokens back.

  python examples/moe_train.py [--steps 300] [--blocks 2] [--capacity 20]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jax_overlap import expert_parallel  # noqa: E402

AXIS = "e"
DEVICES = 8
VOCAB, SEQ, D, HIDDEN = 32, 16, 32, 64
EXPERTS, TOP_K = 8, 2              # 8 experts over the 8 devices: one each
SEQS_PER_DEVICE = 4                # 64 tokens a device
AUX_WEIGHT = 0.05                  # load-balancing loss


def init(key, blocks):
  ks = iter(jax.random.split(key, 8))
  normal = lambda shape, scale: jax.random.normal(next(ks), shape) * scale
  return {
      "embed": normal((VOCAB, D), D ** -0.5),
      "pos": normal((SEQ, D), 0.1),
      # The blocks are stacked on dimension 0 (a Python loop runs them).
      "qkv": normal((blocks, D, 3 * D), D ** -0.5),
      "proj": normal((blocks, D, D), D ** -0.5),
      "router": normal((blocks, D, EXPERTS), D ** -0.5),
      # Expert weights: (blocks, experts, ...); sharded over "e" by expert.
      "w_in": normal((blocks, EXPERTS, D, HIDDEN), D ** -0.5),
      "w_out": normal((blocks, EXPERTS, HIDDEN, D), HIDDEN ** -0.5),
  }


# Dense weights replicated, experts sharded over the devices by expert.
SPECS = {"embed": P(), "pos": P(), "qkv": P(), "proj": P(), "router": P(),
         "w_in": P(None, AXIS), "w_out": P(None, AXIS)}


def layer_norm(x):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def attention(x, qkv, proj):
  """Causal single-head attention over each sequence: x [seqs, SEQ, D]."""
  q, k, v = jnp.split(x @ qkv, 3, axis=-1)
  scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(D)
  causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  scores = jnp.where(causal, scores, -1e9)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), v) @ proj


def expert(params, tokens):
  """One expert: a two-layer MLP on the tokens routed to it, [C, D] -> [C, D]."""
  return jax.nn.gelu(tokens @ params["w_in"]) @ params["w_out"]


def moe_layer(x, router, experts, capacity):
  """Top-2 softmax routing (ours), dispatch and combine (expert_parallel's).

  x: [T, D], this device's tokens; experts: this device's experts, leaves
  [1, ...]. Returns (output, dropped (token, choice) pairs, balance loss).
  """
  probs = jax.nn.softmax(x @ router, axis=-1)                # [T, EXPERTS]
  weights, ids = jax.lax.top_k(probs, TOP_K)                 # [T, 2] each
  weights = weights / weights.sum(-1, keepdims=True)
  y, dropped = expert_parallel(expert, x, ids, weights, experts, axis=AXIS,
                               capacity=capacity, chunks=2)
  # Switch-style balance loss: the share of choices each expert gets times
  # its mean router probability, smallest when the load is even.
  share = jax.nn.one_hot(ids, EXPERTS).sum(1).mean(0) / TOP_K
  balance = EXPERTS * jnp.sum(share * probs.mean(0))
  return y, dropped, balance


def forward(params, tokens, capacity):
  """Logits [seqs, SEQ, VOCAB] of this device's sequences, dropped pairs,
  balance loss (summed over the blocks)."""
  x = params["embed"][tokens] + params["pos"]
  dropped, balance = 0, 0.0
  for b in range(params["qkv"].shape[0]):
    x = layer_norm(x + attention(x, params["qkv"][b], params["proj"][b]))
    experts = {"w_in": params["w_in"][b], "w_out": params["w_out"][b]}
    flat = x.reshape(-1, D)
    y, d, bal = moe_layer(flat, params["router"][b], experts, capacity)
    x = layer_norm(x + y.reshape(x.shape))
    dropped, balance = dropped + d, balance + bal
  return x @ params["embed"].T, dropped, balance


RULE = jax.random.permutation(jax.random.PRNGKey(42), VOCAB)  # the hidden function


def make_batch(key):
  """Sequences whose token t + 2 is RULE[token t]: [seqs, SEQ + 1]."""
  first = jax.random.randint(key, (DEVICES * SEQS_PER_DEVICE, 2), 0, VOCAB)

  def extend(pair, _):
    a, b = pair
    return (b, RULE[a]), RULE[a]
  _, rest = jax.lax.scan(extend, (first[:, 0], first[:, 1]), None, length=SEQ - 1)
  return jnp.concatenate([first, rest.T], axis=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--blocks", type=int, default=2)
  parser.add_argument("--capacity", type=int, default=20,
                      help="tokens each expert takes from each device "
                      "(64 tokens x 2 choices / 8 experts = 16 on average)")
  args = parser.parse_args()

  mesh = jax.make_mesh((DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  params = jax.device_put(init(jax.random.PRNGKey(0), args.blocks),
                          jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS))

  @jax.shard_map(mesh=mesh, in_specs=(SPECS, P(AXIS)), out_specs=(P(), P()))
  def loss_fn(params, seqs):
    logits, dropped, balance = forward(params, seqs[:, :-1], args.capacity)
    # Positions 0 and 1 cannot be predicted: the first two tokens are random.
    logp = jax.nn.log_softmax(logits[:, 1:], axis=-1)
    nll = -jnp.take_along_axis(logp, seqs[:, 2:, None], axis=-1).mean()
    loss = jax.lax.pmean(nll + AUX_WEIGHT * balance, AXIS)
    return loss, (jax.lax.pmean(nll, AXIS), jax.lax.psum(dropped, AXIS))

  opt = optax.adamw(3e-3, weight_decay=1e-4)

  @jax.jit
  def train_step(params, opt_state, key):
    seqs = make_batch(key)
    (_, (nll, dropped)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, seqs)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, nll, dropped

  opt_state = opt.init(params)
  key = jax.random.PRNGKey(1)
  pairs = DEVICES * SEQS_PER_DEVICE * SEQ * TOP_K * args.blocks
  t0 = time.perf_counter()
  for step in range(args.steps):
    key, sub = jax.random.split(key)
    params, opt_state, nll, dropped = train_step(params, opt_state, sub)
    if step == 0 or (step + 1) % max(1, args.steps // 10) == 0:
      print(f"step {step + 1:4d}  loss {float(nll):.4f}  dropped {int(dropped):3d} "
            f"of {pairs} (token, choice) pairs")
  elapsed = time.perf_counter() - t0
  print(f"{args.steps} steps in {elapsed:.1f} s; the experts stayed sharded: "
        f"{params['w_in'].sharding.spec}")


if __name__ == "__main__":
  main()
