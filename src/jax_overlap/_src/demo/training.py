"""The demo's training run: FSDP with overlap, checked, reported, drawn.

`run(options)` trains the transformer of `model.py` on the generated corpus
with `fsdp_scan` on the CPU devices, checks once that its loss and gradients
equal those of a plain unordered scan, prints the overlap report of the
training step, and writes the pictures and JSON. Ctrl-C stops after the
current step; everything is still written.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap._src.demo import model

AXIS = "d"


@dataclasses.dataclass
class Options:
  steps: int = 300
  devices: int = 8
  out: str = "overlap-demo"
  hardware: str | None = None
  batch_per_device: int = 2
  learning_rate: float = 3e-3
  layers: int = 4
  seed: int = 0
  report_width: int = 1024
  say: Callable[[str], None] = print


def mesh_of(devices: int):
  return jax.make_mesh((devices,), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))


def init_on_mesh(optimizer, params, mesh):
  """`optimizer.init(params)` with every leaf on `mesh`: leaves optax makes on
  one device (adam's step count) are put replicated on it, where the
  training step returns them. Why: a step count on one device made the
  second step compile the step again (its input's sharding changed).
  Pinned by tests/cli/demo_training_test.py.

    >>> import optax
    >>> mesh = mesh_of(8)
    >>> state = init_on_mesh(optax.adam(1e-3), {"w": jnp.zeros(8)}, mesh)
    >>> state[0].count.sharding.mesh == mesh
    True
  """
  return jax.tree.map(
      lambda a: a if isinstance(a.sharding, NamedSharding)
      else jax.device_put(a, NamedSharding(mesh, P())), optimizer.init(params))


def losses_for(cfg: model.Config, mesh, param_specs,
               **fsdp_options) -> tuple[Callable, Callable]:
  """(overlapped loss, plain unordered loss), each (params, tokens, targets);
  `fsdp_options` go to the overlapped loss's `fsdp_scan` (e.g. bucket=False)."""
  from jax_overlap._src.patterns.fsdp.scan import fsdp_scan  # noqa: PLC0415

  def plain(block, x, blocks):
    gather = lambda shard: jax.tree.map(
        lambda a: lax.all_gather(a, AXIS, axis=0, tiled=True), shard)
    return lax.scan(lambda x, shard: (block(gather(shard), x), None), x,
                    blocks)[0]

  def loss_with(step_loss):
    @jax.shard_map(mesh=mesh, in_specs=(param_specs, P(AXIS), P(AXIS)),
                   out_specs=P())
    def loss(params, tokens, targets):
      return lax.pmean(step_loss(params, tokens, targets), AXIS)
    return loss

  def overlapped(params, tokens, targets):
    # The embedding runs while layer 0's weights are gathered, the head and
    # loss after the stack; in the backward pass the head's backward hides
    # the last layer's regather, the embedding's the last reduce-scatter.
    return fsdp_scan(
        model.block(cfg), tokens, params["blocks"], axis=AXIS,
        before=lambda tokens: model.embed(params, tokens),
        after=lambda x: model.cross_entropy(model.head(params, x), targets),
        params_first=True, **fsdp_options)

  def unordered(params, tokens, targets):
    return model.cross_entropy(model.logits(cfg, params, tokens, plain),
                               targets)
  return loss_with(overlapped), loss_with(unordered)


def train_step_for(loss_fn, optimizer):
  @jax.jit
  def train_step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    import optax  # noqa: PLC0415
    return optax.apply_updates(params, updates), opt_state, loss
  return train_step


def check_against_plain(ours, plain, params, tokens, targets) -> dict[str, float]:
  """Loss and gradients of the overlapped and the plain step, compared once."""
  grad = lambda f: jax.jit(jax.value_and_grad(f))(params, tokens, targets)
  (l1, g1), (l2, g2) = grad(ours), grad(plain)
  diffs = [float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
           for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))]
  return {"loss_overlapped": float(l1), "loss_plain": float(l2),
          "loss_abs_diff": abs(float(l1) - float(l2)),
          "grad_max_rel_diff": max(diffs)}


class _StopAfterStep:
  """Ctrl-C sets a flag; the loop stops after the step in progress."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    def handler(signum, frame):
      del signum, frame
      self.requested = True
    self._previous = signal.signal(signal.SIGINT, handler)
    return self

  def __exit__(self, *exc):
    signal.signal(signal.SIGINT, self._previous)
    return False


def _progress(total: int):
  """A rich progress bar (step, loss, steps/s, ETA), or plain lines."""
  try:
    from rich.progress import (BarColumn, Progress, TextColumn,  # noqa: PLC0415
                               TimeRemainingColumn)
  except ImportError:
    return None
  return Progress(
      TextColumn("step {task.completed:>4}/{task.total}"), BarColumn(),
      TextColumn("loss {task.fields[loss]:.4f}"),
      TextColumn("{task.fields[rate]:.1f} steps/s"),
      TextColumn("ETA"), TimeRemainingColumn())


def train(opts: Options, train_step, params, opt_state, corpus, cfg,
          ) -> tuple[Any, list[float], bool]:
  """Runs up to `opts.steps` steps; returns (params, losses, interrupted)."""
  rng = np.random.default_rng(opts.seed)
  batch = opts.batch_per_device * opts.devices
  sharding = NamedSharding(mesh_of(opts.devices), P(AXIS))
  losses: list[float] = []
  progress = _progress(opts.steps)
  t0 = time.perf_counter()
  with _StopAfterStep() as stop:
    if progress is not None:
      progress.start()
      task = progress.add_task("train", total=opts.steps, loss=float("nan"),
                               rate=0.0)
    try:
      for step in range(opts.steps):
        tokens, targets = (jax.device_put(a, sharding)
                           for a in corpus.batch(rng, batch, cfg.seq))
        params, opt_state, loss = train_step(params, opt_state, tokens, targets)
        losses.append(float(loss))
        rate = (step + 1) / (time.perf_counter() - t0)
        if progress is not None:
          progress.update(task, completed=step + 1, loss=losses[-1], rate=rate)
        elif step % max(1, opts.steps // 10) == 0 or step + 1 == opts.steps:
          opts.say(f"step {step + 1:4d}/{opts.steps}  loss {losses[-1]:.4f}  "
                   f"{rate:.1f} steps/s")
        if stop.requested:
          break
    finally:
      if progress is not None:
        progress.stop()
  return params, losses, stop.requested


def sample(cfg, params, corpus, prompt: str, n: int) -> str:
  """Greedy continuation of `prompt` (at least `cfg.seq` characters), on one
  device with a plain scan over the blocks, in one compiled loop."""
  run_blocks = lambda block, x, blocks: lax.scan(
      lambda x, w: (block(w, x), None), x, blocks)[0]
  host = jax.tree.map(lambda p: jnp.asarray(np.asarray(p)), params)
  ids = np.array([corpus.chars.index(c) for c in prompt[-cfg.seq:]], np.int32)

  @jax.jit
  def generate(ids):
    buffer = jnp.concatenate([ids, jnp.zeros((n,), jnp.int32)])

    def one(i, buffer):
      window = lax.dynamic_slice_in_dim(buffer, i, cfg.seq)
      nxt = jnp.argmax(model.logits(cfg, host, window[None], run_blocks)[0, -1])
      return buffer.at[i + cfg.seq].set(nxt.astype(jnp.int32))
    return lax.fori_loop(0, n, one, buffer)[cfg.seq:]
  return corpus.decode(generate(ids))


def abstract_params(cfg: model.Config, mesh) -> tuple[Any, Any]:
  """(param specs, params as ShapeDtypeStructs sharded on `mesh` by those
  specs): the model's parameters traced from shapes alone, nothing allocated."""
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.PRNGKey(0)))
  specs = model.specs(shapes, AXIS)
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=NamedSharding(mesh, s)),
      shapes, specs)
  return specs, params


def overlap_reports(cfg: model.Config, opts: Options, optimizer) -> dict:
  """The overlap report of the training step, ours and the plain scan's, at
  `opts.report_width` (traced from shapes alone: nothing is allocated)."""
  from jax_overlap._src.inspection.api import overlap_report  # noqa: PLC0415
  if opts.report_width:
    cfg = dataclasses.replace(cfg, d=opts.report_width,
                              hidden=4 * opts.report_width,
                              heads=max(1, opts.report_width // 128), seq=512)
    batch = 4 * opts.devices
  else:
    batch = opts.batch_per_device * opts.devices
  mesh = mesh_of(opts.devices)
  param_specs, params = abstract_params(cfg, mesh)
  opt_state = jax.eval_shape(optimizer.init, params)
  tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32,
                                sharding=NamedSharding(mesh, P(AXIS)))
  ours, plain = losses_for(cfg, mesh, param_specs)
  return {name: overlap_report(train_step_for(loss, optimizer),
                              hardware=opts.hardware)(
                                  params, opt_state, tokens, tokens)
          for name, loss in (("fsdp_scan", ours), ("plain scan", plain))}


def compare_line(reports: dict) -> str:
  """One line: how much communication each version leaves exposed."""
  parts = []
  for name, report in reports.items():
    t = report.totals
    hidden = max(0.0, 1 - t["exposed_s"] / t["comm_s"]) if t["comm_s"] else 0.0
    parts.append(f"{name}: {t['exposed_s'] * 1e6:.0f} us of "
                 f"{t['comm_s'] * 1e6:.0f} us exposed ({hidden:.0%} hidden)")
  t = reports["fsdp_scan"].totals
  above = (t["exposed_s"] - t["bound_exposed_s"]) / t["comm_s"] if t[
      "comm_s"] else 0.0
  return ("   In short, modelled on " + reports["fsdp_scan"].hardware.name
          + ": " + "; ".join(parts) + ". No schedule that keeps the data "
          f"dependencies exposes less than {t['bound_exposed_s'] * 1e6:.0f} "
          f"us; fsdp_scan exposes {above:.1%} of its communication above "
          "that.")


def measured_line(train_step, params, opt_state, batch) -> str:
  """One line: the trained step measured under jax's profiler (2 steps), as
  device means, beside the modelled line above."""
  from jax_overlap._src.inspection.measured.measure import measure  # noqa: PLC0415
  report = measure(train_step, steps=2, warmup=0)(params, opt_state, *batch)
  totals = list(report.totals.values())
  if not totals or not any(t["comm_s"] for t in totals):
    return "   Measured (jax.profiler, 2 steps): no collective events found."
  mean = lambda k: sum(t[k] for t in totals) / len(totals)  # noqa: E731
  line = (f"   Measured (jax.profiler, 2 steps of the step trained above, on "
          f"{len(totals)} {report.backend.upper()} devices): "
          f"{mean('exposed_s') * 1e6:.0f} us of {mean('comm_s') * 1e6:.0f} us "
          f"of collectives a device exposed "
          f"({mean('hidden_s') / mean('comm_s'):.0%} hidden).")
  if report.backend == "cpu":
    line += (" On CPU the runtime blocks on collectives, so "
             + ("all" if not mean("hidden_s") else "nearly all (only independent "
                "work on its other threads ran beside them)")
             + " of it is exposed, and these are times of threads meeting in "
             "memory, not of a network: measure on GPUs for the figure that "
             "matters.")
  return line


def plot_losses(losses: list[float], path: pathlib.Path) -> bool:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
  ax.plot(np.arange(1, len(losses) + 1), losses, lw=1.2)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy")
  ax.set_title("jax-overlap demo: training loss (fsdp_scan, 8 CPU devices)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def write_json(path: pathlib.Path, data: dict) -> None:
  path.write_text(json.dumps(data, indent=2))


def write_outputs(out: pathlib.Path, report, demo: dict, losses: list[float],
                  say: Callable[[str], None], t_start: float, devices: int) -> None:
  """Writes the report's timeline, trace and JSON (with `demo` beside the
  report's own fields) and the loss plot into `out`, then says what was
  written and what ran; both demos end so (tests/cli/demo_test.py)."""
  written = [out / "timeline.png", out / "trace.json", out / "report.json"]
  report.save_timeline(written[0])
  report.save_trace(written[1])
  write_json(written[2], dict(report.to_dict(), demo=demo))
  if plot_losses(losses, out / "loss.png"):
    written.append(out / "loss.png")
  say("\n4. Written (open trace.json in ui.perfetto.dev):")
  for path in written:
    say(f"   {path}")
  say(f"\nDone in {time.perf_counter() - t_start:.0f} s. What ran: the training "
      f"on {devices} CPU devices. What is modelled: every time in the "
      "report and the timeline.")
