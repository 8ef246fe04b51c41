"""The demo's transformer pipelined: its blocks in p stages over mesh axis
'pp' (2p, two chunks a device, for interleaved, ZB-V and DualPipeV, laid out
by `pipeline_stage_layout`), each stage an `fsdp_scan` over its blocks
sharded over 'fsdp'.

`pipeline_loss` takes a loss of the last stage's activation alone (no
parameters), so this model reads its logits off the first `vocab` features
of the last block's output; the embedding runs before the pipeline (its
gradient comes back through the pipeline's `xs`). `sequential_loss` is the
same model without a pipeline, the reference the demo checks against
(tests/cli/demo_test.py).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_overlap._src.demo import model

PP, FSDP = "pp", "fsdp"

#: Chunks a device for the schedules that run more than one.
CHUNKS = {"interleaved": 2, "zb-v": 2, "dualpipev": 2}


def chunks(schedule: str) -> int:
  return CHUNKS.get(schedule, 1)


def init(cfg: model.Config, stages: int, key, schedule: str = "1f1b") -> dict:
  """`embed` (vocab, d) replicated; `blocks`, every leaf [p*v, layers/(p*v),
  ...], the p*v stages laid out for `schedule` (device d's entries
  consecutive)."""
  from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout  # noqa: PLC0415
  n = stages * chunks(schedule)
  if cfg.layers % n or cfg.vocab > cfg.d:
    raise ValueError(f"the pipelined demo needs layers ({cfg.layers}) a "
                     f"multiple of stages x chunks ({n}) and vocab ({cfg.vocab}) "
                     f"<= width ({cfg.d})")
  params = model.init(cfg, key)
  blocks = jax.tree.map(lambda a: a.reshape((n, cfg.layers // n) + a.shape[1:]),
                        params["blocks"])
  return {"embed": params["embed"],
          "blocks": pipeline_stage_layout(blocks, stages, schedule=schedule)}


def specs(params: dict) -> dict:
  """Stages over 'pp'; in a stage each leaf's first dim after the layer dim
  over 'fsdp'; the embedding replicated."""
  return {"embed": P(), "blocks": jax.tree.map(
      lambda a: P(PP, None, FSDP, *[None] * (a.ndim - 3)), params["blocks"])}


def mesh_of(stages: int, fsdp: int):
  return jax.make_mesh((stages, fsdp), (PP, FSDP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:stages * fsdp])


def logits_loss(vocab: int):
  def loss(y, targets):
    return model.cross_entropy(y[..., :vocab], targets)
  return loss


def pipelined_loss(cfg: model.Config, mesh, param_specs, microbatches: int,
                   schedule: str = "1f1b", *, gather_once: bool = False,
                   recompute=None):
  """(params, tokens, targets) -> the mean loss; tokens [batch, seq] sharded
  over 'fsdp', split into `microbatches` along the batch. `gather_once`: the
  stages' blocks gathered over 'fsdp' once, before the pipeline, each stage a
  plain scan (docs/pipeline.md "Gathering a stage's weights once a step").
  `recompute`: `pipeline_loss`'s (None: its default)."""
  from jax_overlap._src.patterns.fsdp.scan import fsdp_scan  # noqa: PLC0415
  from jax_overlap._src.patterns.pipeline.loss import pipeline_loss  # noqa: PLC0415

  def stage(w, x):            # w: this stage's blocks, [layers/p, d/fsdp, ...]
    if gather_once:           # [layers/p, d, ...], whole; unrolled (a stage's
      for layer in range(jax.tree.leaves(w)[0].shape[0]):   # few blocks)
        x = model.block(cfg)(jax.tree.map(lambda a, k=layer: a[k], w), x)
      return x
    return fsdp_scan(model.block(cfg), x, w, axis=FSDP, shard_dims=1,
                     params_first=True)

  def body(params, tokens, targets):
    split = lambda a: a.reshape((microbatches, -1) + a.shape[1:])
    xs = model.embed(params, split(tokens))
    blocks = params["blocks"]
    if gather_once:           # dim 2 of [1, layers/p, d/fsdp, ...]
      blocks = jax.tree.map(
          lambda a: jax.lax.all_gather(a, FSDP, axis=2, tiled=True), blocks)
    how = {} if recompute is None else {"recompute": recompute}
    loss = pipeline_loss(stage, logits_loss(cfg.vocab), blocks, xs,
                         split(targets), axis=PP, schedule=schedule,
                         virtual_stages=chunks(schedule), **how)
    return jax.lax.pmean(loss, FSDP)

  return jax.shard_map(body, mesh=mesh,
                       in_specs=(param_specs, P(FSDP), P(FSDP)), out_specs=P())


def sequential_loss(cfg: model.Config, stages: int = 4, schedule: str = "1f1b"):
  """The same model on one device, no pipeline: the reference (its blocks
  taken back out of `schedule`'s layout over `stages` devices)."""
  from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout  # noqa: PLC0415

  def loss(params, tokens, targets):
    blocks = pipeline_stage_layout(params["blocks"], stages, inverse=True,
                                   schedule=schedule)
    blocks = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), blocks)
    x = jax.lax.scan(lambda x, w: (model.block(cfg)(w, x), None),
                     model.embed(params, tokens), blocks)[0]
    return logits_loss(cfg.vocab)(x, targets)
  return loss
