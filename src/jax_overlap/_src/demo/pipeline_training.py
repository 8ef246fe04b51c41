"""`jax-overlap demo --pipeline SCHEDULE`: the demo's transformer trained over
4 pipeline stages x 2 FSDP devices (pipeline.py), checked once against the
same model without a pipeline, its training step reported (the report's
rows per stage show the schedule's bubble), drawn and written.
Pinned by tests/cli/demo_test.py.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap._src.demo import corpus as corpus_lib
from jax_overlap._src.demo import model, pipeline, training

STAGES, FSDP = 4, 2


def _place(tree, mesh, specs):
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                      tree, specs)


def _shapes(tree, mesh, specs):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs)


def run(opts: training.Options, schedule: str, microbatches: int = 8) -> int:
  import optax  # noqa: PLC0415
  say = opts.say
  out = pathlib.Path(opts.out)
  out.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()
  say(f"jax-overlap demo --pipeline {schedule}: jax {jax.__version__}, "
      f"{STAGES} pipeline stages x {FSDP} FSDP devices (virtual CPU devices: "
      "collectives are memory copies here, so their timing is modelled)\n")
  corpus = corpus_lib.Corpus(corpus_lib.generate())
  cfg = model.Config(vocab=corpus.vocab_size, layers=2 * STAGES)
  mesh = pipeline.mesh_of(STAGES, FSDP)
  v = pipeline.chunks(schedule)
  params = pipeline.init(cfg, STAGES, jax.random.PRNGKey(opts.seed), schedule)
  param_specs = pipeline.specs(params)
  params = _place(params, mesh, param_specs)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  say(f"Model: decoder-only transformer, {cfg.layers} blocks in {STAGES * v} "
      f"stages ({cfg.layers // (STAGES * v)} a stage, {v} a device, fsdp_scan "
      "over 'fsdp'), width "
      f"{cfg.d}, {n_params / 1e3:.0f}k parameters; {microbatches} microbatches "
      f"a step, schedule {schedule}.")
  from jax_overlap._src.patterns.pipeline.placing import pipeline_schedule  # noqa: PLC0415
  plan = pipeline_schedule(schedule, STAGES, microbatches, v)
  sim = plan.simulate()
  say(f"   The schedule: {len(plan.table)} ticks, bubble {sim.bubble_fraction:.1%}"
      f" under unit costs, peak activations a stage {list(sim.peak_activations)}"
      " (print(jax_overlap.pipeline_schedule(...)) shows the table).")

  loss = pipeline.pipelined_loss(cfg, mesh, param_specs, microbatches, schedule)
  batch_sharding = NamedSharding(mesh, P(pipeline.FSDP))
  batch = microbatches * FSDP
  probe = [jax.device_put(a, batch_sharding) for a in
           corpus.batch(np.random.default_rng(99), batch, cfg.seq)]
  say("\n1. Check: the pipelined step against the same model without a "
      "pipeline (same batch, same weights)")
  grad_step = jax.jit(jax.value_and_grad(loss))   # compiled once: check, training, report
  (l1, g1) = grad_step(params, *probe)
  (l2, g2) = jax.jit(jax.value_and_grad(pipeline.sequential_loss(
      cfg, STAGES, schedule)))(params, *probe)
  diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
             for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)))
  same = abs(float(l1) - float(l2)) < 1e-4 and diff < 1e-4
  say(f"   loss {float(l1):.6f} vs {float(l2):.6f}; largest gradient difference "
      f"{diff:.1e} of its leaf's scale: {'the same' if same else 'DIFFERENT'}")

  say(f"\n2. Training {opts.steps} steps")
  optimizer = optax.adamw(opts.learning_rate, weight_decay=0.01)
  @jax.jit
  def update(grads, opt_state, params):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = training.init_on_mesh(optimizer, params, mesh)
  rng = np.random.default_rng(opts.seed)
  losses = []
  t0 = time.perf_counter()
  for i in range(opts.steps):
    tokens, targets = (jax.device_put(a, batch_sharding)
                       for a in corpus.batch(rng, batch, cfg.seq))
    value, grads = grad_step(params, tokens, targets)
    params, opt_state = update(grads, opt_state, params)
    losses.append(float(value))
    if i % max(1, opts.steps // 10) == 0 or i + 1 == opts.steps:
      say(f"   step {i + 1:4d}/{opts.steps}  loss {losses[-1]:.4f}  "
          f"{(i + 1) / (time.perf_counter() - t0):.2f} steps/s")
  say(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")

  width = opts.report_width or cfg.d
  say(f"\n3. Overlap report of the training step's value_and_grad at width {width} "
      "(modelled, not measured)")
  report = _report(cfg, width, mesh, microbatches, schedule, opts.hardware,
                   grad_step if width == cfg.d else None)
  say(_collapse_cond_notes(str(report)))
  ticks = sorted({c.leaf.split(":")[0] for c in report.collectives
                  if c.leaf and c.leaf.startswith("pipeline tick")})
  say(f"   {len(ticks)} ticks send (each send's leaf names its tick and every "
      "stage's action); timeline.png draws a row a stage, its idle ticks the "
      "bubble.")
  training.write_outputs(out, report, {
      "pipeline": schedule, "stages": STAGES, "fsdp": FSDP,
      "microbatches": microbatches, "steps_run": len(losses), "losses": losses,
      "check": {"loss_pipelined": float(l1), "loss_sequential": float(l2),
                "grad_max_rel_diff": diff},
      "bubble_fraction_unit_costs": sim.bubble_fraction,
      "report_width": width}, losses, say, t_start, STAGES * FSDP)
  return 0 if same else 1


def _report(cfg, width, mesh, microbatches, schedule, hardware, grad_step=None):
  """The report of the step's value_and_grad at `width` (the optimizer's
  update moves nothing), traced from shapes alone; `grad_step`, the one
  trained, where the width is the trained one."""
  from jax_overlap._src.inspection.api import overlap_report  # noqa: PLC0415
  if width != cfg.d:
    cfg = dataclasses.replace(cfg, d=width, hidden=4 * width,
                              heads=max(1, width // 128), seq=512)
  shapes = jax.eval_shape(lambda: pipeline.init(cfg, STAGES, jax.random.PRNGKey(0),
                                                schedule))
  param_specs = pipeline.specs(shapes)
  params = _shapes(shapes, mesh, param_specs)
  tokens = jax.ShapeDtypeStruct((microbatches * FSDP, cfg.seq), jnp.int32,
                                sharding=NamedSharding(mesh, P(pipeline.FSDP)))
  if grad_step is None:
    grad_step = jax.jit(jax.value_and_grad(pipeline.pipelined_loss(
        cfg, mesh, param_specs, microbatches, schedule)))
  return overlap_report(grad_step, hardware=hardware)(params, tokens, tokens)


def _collapse_cond_notes(text: str) -> str:
  """The report notes each tick's switch; the demo says it once."""
  lines = text.splitlines()
  conds = [ln for ln in lines if ln.startswith("Note: A cond at ")]
  if len(conds) < 2:
    return text
  first = lines.index(conds[0])
  kept = [ln for ln in lines if ln not in conds]
  kept.insert(first, f"Note: {len(conds)} conds (each tick's switch over the "
              "stages' actions): the costliest branch of each is modelled.")
  return "\n".join(kept)
