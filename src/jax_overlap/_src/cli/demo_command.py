"""Train a small transformer with FSDP overlap on CPU devices, and show the overlap.

  jax-overlap demo [--steps N] [--devices N] [--out DIR] [--hardware NAME|FILE]
  jax-overlap demo --pipeline SCHEDULE [--steps N] [--out DIR] ...
  jax-overlap demo --mesh pp=2,fsdp=2,tp=2 [--tensor psum] [--steps N]

Trains a decoder-only transformer (4 blocks, plain jax, optax AdamW) on a
generated text corpus with `fsdp_scan` on N virtual CPU devices: each block's
weights are sharded over the devices, gathered one layer ahead while the
previous layer computes, and their gradients reduce-scattered one layer
behind. Checks once that the overlapped step gives the same loss and
gradients as a plain unordered scan, prints the overlap report of the
training step (times modelled on a hardware profile, not measured: this CPU
runs collectives as memory copies), and writes timeline.png, trace.json
(ui.perfetto.dev), report.json and loss.png to DIR. Ctrl-C stops after the
current step and still writes everything.

With --pipeline (gpipe, 1f1b, zb-h1, interleaved, zb-v or dualpipev) it
trains the same transformer over 4 pipeline stages x 2 FSDP devices with
`pipeline_loss` instead, checks it against the model without a pipeline,
and reports the pipelined step (a row per stage on the timeline: the bubble).

With --mesh it trains examples/llama_4d.py's Llama-style decoder on a mesh of
the named axes (pp: pipeline_loss; fsdp or dp; tp, cp or ep), on as many
devices as their sizes multiply to, checks it once against the model as one
program and prints the loss.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

NAME = "demo"
HELP = "train a small transformer with FSDP overlap and show the overlap"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.formatter_class = argparse.RawDescriptionHelpFormatter
  parser.add_argument("--steps", type=int, default=300,
                      help="training steps (default 300)")
  parser.add_argument("--devices", type=int, default=8,
                      help="virtual CPU devices to shard over (default 8)")
  parser.add_argument("--out", default="overlap-demo",
                      help="where to write the pictures and JSON "
                      "(default overlap-demo)")
  parser.add_argument("--hardware", metavar="NAME|FILE", default=None,
                      help="hardware profile the report models (default h100)")
  parser.add_argument("--report-width", type=int, default=1024,
                      help="model width of the step the report models "
                      "(default 1024; 0: the small step trained here, whose "
                      "transfers are too small to hide anything)")
  parser.add_argument("--pipeline", metavar="SCHEDULE", default=None,
                      choices=("gpipe", "1f1b", "zb-h1", "interleaved", "zb-v",
                               "dualpipev"),
                      help="train over 4 pipeline stages x 2 FSDP devices with "
                      "this schedule (gpipe, 1f1b, zb-h1; interleaved, zb-v, "
                      "dualpipev with two chunks a device) instead of FSDP alone")
  parser.add_argument("--mesh", metavar="AXIS=N,...", default=None,
                      help="train examples/llama_4d.py's decoder on a mesh of these "
                      "axes: pp, fsdp or dp, tp or cp or ep (e.g. pp=2,fsdp=2,tp=2)")
  parser.add_argument("--tensor", choices=("collective", "psum"), default="collective",
                      help="with --mesh and tp: tensor parallelism by collective matmul "
                      "rings (default) or by a psum")
  parser.add_argument("--microbatches", type=int, default=8,
                      help="with --pipeline: microbatches a step (default 8, at "
                      "least 4)")


def run(args: argparse.Namespace) -> int:
  if args.steps < 1:
    return _fail(f"--steps must be >= 1, got {args.steps}")
  if args.mesh is not None:
    return _run_mesh(args)
  if args.pipeline and args.devices != 8:
    return _fail(f"--pipeline runs on 8 devices (4 stages x 2 FSDP), got "
                 f"--devices {args.devices}")
  if args.pipeline and args.microbatches < 4:
    return _fail(f"--microbatches must be >= 4 (the stages), got {args.microbatches}")
  if args.pipeline == "dualpipev" and args.microbatches < 8:
    return _fail(f"--pipeline dualpipev needs --microbatches >= 8 (twice the "
                 f"stages), got {args.microbatches}")
  if args.pipeline == "interleaved" and args.microbatches % 4:
    return _fail(f"--pipeline interleaved needs --microbatches a multiple of 4 "
                 f"(the stages), got {args.microbatches}")
  if args.devices < 1 or 64 % args.devices:
    return _fail(f"--devices must divide 64 (the model's width), got {args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # noqa: PLC0415
  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError as e:   # the backend already started with other devices
    return _fail(f"cannot set {args.devices} CPU devices here: {e}")
  try:
    import optax  # noqa: F401,PLC0415
  except ImportError:
    return _fail("the demo needs optax: pip install 'jax-overlap[demo]'")
  from jax_overlap._src.demo.training import Options  # noqa: PLC0415
  if args.report_width < 0 or args.report_width % 64:
    return _fail(f"--report-width must be 0 or a multiple of 64, got "
                 f"{args.report_width}")
  opts = Options(steps=args.steps, devices=args.devices, out=args.out,
                 hardware=args.hardware, report_width=args.report_width)
  if args.pipeline:
    from jax_overlap._src.demo import pipeline_training  # noqa: PLC0415
    return pipeline_training.run(opts, args.pipeline, args.microbatches)
  return demo(opts)


def _run_mesh(args: argparse.Namespace) -> int:
  from jax_overlap._src.demo import mesh_training  # noqa: PLC0415
  if args.pipeline:
    return _fail("--mesh and --pipeline are two demos: give one")
  try:
    example = mesh_training.load_example()
    axes = example.parse_mesh(args.mesh)
    example.Plan(axes, tensor=args.tensor)
  except (FileNotFoundError, ValueError) as e:
    return _fail(str(e))
  n = mesh_training.devices_of(axes)
  import jax  # noqa: PLC0415
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError as e:   # the backend already started with other devices
    return _fail(f"cannot set {n} CPU devices here: {e}")
  try:
    import optax  # noqa: F401,PLC0415
  except ImportError:
    return _fail("the demo needs optax: pip install 'jax-overlap[demo]'")
  from jax_overlap._src.demo.training import Options  # noqa: PLC0415
  return mesh_training.run(Options(steps=args.steps, devices=n), axes, args.tensor)


def demo(opts) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  from jax_overlap._src.demo import corpus as corpus_lib  # noqa: PLC0415
  from jax_overlap._src.demo import model, training  # noqa: PLC0415
  from jax_overlap._src.inspection.errors import HardwareProfileError  # noqa: PLC0415

  say = opts.say
  out = pathlib.Path(opts.out)
  out.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()
  devices = jax.devices()
  say(f"jax-overlap demo: jax {jax.__version__}, {len(devices)} "
      f"{devices[0].platform.upper()} devices (virtual: collectives are memory "
      "copies here, so their timing is modelled, not measured)\n")

  text = corpus_lib.generate()
  corpus = corpus_lib.Corpus(text)
  cfg = model.Config(vocab=corpus.vocab_size, layers=opts.layers)
  mesh = training.mesh_of(opts.devices)
  params = model.init(cfg, jax.random.PRNGKey(opts.seed))
  param_specs = model.specs(params, training.AXIS)
  params = jax.device_put(params, jax.tree.map(
      lambda s: NamedSharding(mesh, s), param_specs))
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  say(f"Model: decoder-only transformer, {cfg.layers} blocks, width {cfg.d}, "
      f"{n_params / 1e3:.0f}k parameters; blocks sharded over {opts.devices} "
      f"devices, run by fsdp_scan. Corpus: {len(text) / 1e3:.0f}k generated "
      f"characters, {corpus.vocab_size} symbols.")

  ours, plain = training.losses_for(cfg, mesh, param_specs)
  optimizer = optax.adamw(opts.learning_rate, weight_decay=0.01)
  train_step = training.train_step_for(ours, optimizer)
  opt_state = training.init_on_mesh(optimizer, params, mesh)
  sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(training.AXIS))
  batch = opts.batch_per_device * opts.devices
  probe = [jax.device_put(a, sharding) for a in
           corpus.batch(np.random.default_rng(99), batch, cfg.seq)]

  say("\n1. Check: the overlapped step against a plain, unordered scan "
      "(same batch, same weights)")
  check = training.check_against_plain(ours, plain, params, *probe)
  same = check["loss_abs_diff"] < 1e-4 and check["grad_max_rel_diff"] < 1e-4
  say(f"   loss {check['loss_overlapped']:.6f} vs {check['loss_plain']:.6f}; "
      f"largest gradient difference {check['grad_max_rel_diff']:.1e} of its "
      f"leaf's scale: {'the same' if same else 'DIFFERENT'}")

  say(f"\n2. Training {opts.steps} steps (Ctrl-C stops after the current step)")
  params, losses, interrupted = training.train(
      opts, train_step, params, opt_state, corpus, cfg)
  if losses:
    say(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"
        + (" (stopped by Ctrl-C)" if interrupted else ""))
    prompt = corpus_lib.generate(200, seed=7)[:cfg.seq]
    say(f"   greedy sample after {prompt[-24:]!r}: "
        f"{training.sample(cfg, params, corpus, prompt, 60)!r}")

  width = opts.report_width or cfg.d
  say(f"\n3. Overlap report of the training step at width {width} "
      "(modelled, not measured)")
  if opts.report_width:
    say(f"   The step trained above moves kilobytes: on any accelerator its "
        "transfers would be all latency. The report models the same program "
        f"at width {width} ({opts.layers} blocks, sequence 512, 4 sequences a "
        "device), traced here, never run.")
  try:
    reports = training.overlap_reports(cfg, opts, optimizer)
  except HardwareProfileError as e:
    return _fail(str(e))
  report = reports["fsdp_scan"]
  say(str(report))
  say(training.compare_line(reports))
  say(training.measured_line(train_step, params, opt_state, probe))

  training.write_outputs(out, report, {
      "steps_run": len(losses), "losses": losses,
      "interrupted": interrupted, "check": check, "devices": opts.devices,
      "report_width": width,
      "plain_scan_totals": reports["plain scan"].to_dict()["totals"]},
      losses, say, t_start, opts.devices)
  return 0 if same else 1


def _fail(message: str) -> int:
  print(f"jax-overlap demo: {message}", file=sys.stderr)
  return 2
