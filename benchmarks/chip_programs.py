"""The programs the chip benchmarks run, and how they are timed.

Shared by `calibrate.py`, `chip_fsdp_vs_scan.py`, `chip_ring_vs_flash.py` and
`chip_captures.py`, so that a program measured by one is the same module as
in the others (the same HLO, so jax's persistent compilation cache, where
the caller turns it on, compiles it once). Every builder returns
`(jitted, args)`; `time_program` compiles and times it.

The train step is the demo transformer's (`jax_overlap._src.demo.model`)
at the width of the issues' tables: 8 layers, width 1024, hidden 4096, 8
heads, 16 sequences of 128 tokens, vocab 256, `value_and_grad` of the loss
plus an SGD update, on a 1-device mesh (axis 'd').

`SMALL=1` in the environment shrinks every size (the same code paths), for
a check on a CPU before the chip runs it.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

SMALL = os.environ.get("SMALL") == "1"
AXIS = "d"
TRAIN = dict(layers=8, d=1024, hidden=4096, heads=8, seq=128, vocab=256, batch=16)
if SMALL:
  TRAIN = dict(layers=3, d=128, hidden=256, heads=2, seq=32, vocab=64, batch=4)


def mesh1(axis: str = AXIS):
  """A 1-device mesh: XLA removes gathers and reductions over it, keeps a
  collective-permute as an async pair."""
  return jax.make_mesh((1,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])


def environment() -> dict:
  """What ran the measurements: versions and the device."""
  import jaxlib  # noqa: PLC0415
  out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "device_kind": jax.devices()[0].device_kind,
         "platform": jax.devices()[0].platform,
         "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  try:
    import importlib.metadata as md  # noqa: PLC0415
    out["libtpu"] = md.version("libtpu")
  except Exception:  # noqa: BLE001 - not installed as a distribution
    try:
      import libtpu  # noqa: PLC0415
      out["libtpu"] = getattr(libtpu, "__version__", "unknown")
    except Exception:  # noqa: BLE001
      out["libtpu"] = None
  return out


def module_times(xspace: bytes, module: str) -> list[float]:
  """Each run's time of `module` on device 0: its "XLA Modules" events."""
  import warnings  # noqa: PLC0415
  from jax.profiler import ProfileData  # noqa: PLC0415
  profile = ProfileData.from_serialized_xspace(xspace)
  out = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for plane in profile.planes:
      if plane.name.startswith("/device:") and plane.name.endswith(":0"):
        for line in plane.lines:
          if line.name == "XLA Modules":
            out += [e.duration_ns * 1e-9 for e in line.events
                    if e.name.split("(")[0] == module]
  return out


def device_times(compiled, args, runs: int = 3) -> list[float]:
  """The device's own time of each of `runs` runs: the "XLA Modules" events
  of a `jax.profiler.trace` capture (TPU), without the host's dispatch and
  wait that a wall time holds; [] where the capture has none (CPU)."""
  import pathlib  # noqa: PLC0415
  import re  # noqa: PLC0415
  import tempfile  # noqa: PLC0415
  module = re.match(r"HloModule (\S+?),", compiled.as_text()).group(1)
  with tempfile.TemporaryDirectory() as where:
    with jax.profiler.trace(where):
      for _ in range(runs):
        jax.block_until_ready(compiled(*args))
    (found,) = pathlib.Path(where).rglob("*.xplane.pb")
    return module_times(found.read_bytes(), module)


def time_program(jitted, args, *, min_runs: int = 5, max_runs: int = 30,
                 budget_s: float = 2.0, device: bool = True) -> dict:
  """Compiles `jitted` at `args`, runs it twice to warm up, then times runs
  (each to `block_until_ready`) until `budget_s` or `max_runs`; the median
  wall time, the runs' times, the compile time and the compiled HLO text;
  with `device`, also the median of the device's own time of 3 runs under
  the profiler (`device_s`, TPU only: a wall time holds the host's dispatch,
  about 0.5 to 1 ms a call on the v5e machine)."""
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(2):
    jax.block_until_ready(compiled(*args))
  times: list[float] = []
  start = time.perf_counter()
  while len(times) < max_runs and (len(times) < min_runs
                                   or time.perf_counter() - start < budget_s):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  out = {"median_s": statistics.median(times), "min_s": min(times),
         "runs": len(times), "times_s": times, "compile_s": compile_s,
         "hlo": compiled.as_text()}
  if device and jax.devices()[0].platform == "tpu":
    try:
      on_device = device_times(compiled, args)
      if on_device:
        out.update(device_s=statistics.median(on_device), device_times_s=on_device)
    except Exception as e:  # noqa: BLE001 - the wall time stands without it
      out["device_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


# --- the demo transformer's train step ---------------------------------------------

def train_config(layers: int | None = None):
  from jax_overlap._src.demo import model  # noqa: PLC0415
  t = TRAIN
  return model.Config(vocab=t["vocab"], d=t["d"], heads=t["heads"],
                      hidden=t["hidden"], layers=layers or t["layers"], seq=t["seq"])


def train_inputs(dtype=jnp.float32, mesh=None):
  """(params, tokens, targets, specs) on `mesh`; params in `dtype`."""
  from jax_overlap._src.demo import model  # noqa: PLC0415
  mesh = mesh or mesh1()
  cfg = train_config()
  params = jax.tree.map(lambda a: a.astype(dtype),
                        model.init(cfg, jax.random.PRNGKey(0)))
  specs = model.specs(params, AXIS)
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        params, specs)
  rng = np.random.default_rng(0)
  tok = rng.integers(0, cfg.vocab, (TRAIN["batch"], cfg.seq), dtype=np.int32)
  put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P(AXIS)))
  return params, put(tok), put(np.roll(tok, -1, axis=1)), specs


TRAIN_VARIANTS = ("jit, lax.scan", "jit, unrolled", "shard_map, lax.scan",
                  "fsdp_scan", "fsdp_scan bucket=False")


def train_loss(variant: str, mesh, specs):
  """The loss of one train-step variant, (params, tokens, targets) -> loss.

  - 'jit, lax.scan': no shard_map; a `lax.scan` over the stacked blocks.
  - 'jit, unrolled': no shard_map; the blocks in a Python loop.
  - 'shard_map, lax.scan': the demo's plain scan (`training.losses_for`'s
    second loss): `lax.all_gather` of each layer's shards in the body.
  - 'fsdp_scan' / 'fsdp_scan bucket=False': the demo's loss
    (`training.losses_for`'s first), with `bucket=False` for the second.
  """
  from jax_overlap._src.demo import model, training  # noqa: PLC0415
  assert training.AXIS == AXIS
  cfg = train_config()
  if variant.startswith("fsdp_scan"):
    options = {"bucket": False} if "bucket=False" in variant else {}
    return training.losses_for(cfg, mesh, specs, **options)[0]
  if variant == "shard_map, lax.scan":
    return training.losses_for(cfg, mesh, specs)[1]
  if variant == "jit, lax.scan":
    run = lambda block, x, blocks: lax.scan(
        lambda x, w: (block(w, x), None), x, blocks)[0]
  elif variant == "jit, unrolled":
    def run(block, x, blocks):
      for i in range(jax.tree.leaves(blocks)[0].shape[0]):
        x = block(jax.tree.map(lambda a: a[i], blocks), x)  # noqa: B023
      return x
  else:
    raise ValueError(f"unknown train-step variant {variant!r}; one of "
                     f"{TRAIN_VARIANTS}")

  def loss(params, tokens, targets):
    return model.cross_entropy(model.logits(cfg, params, tokens, run), targets)
  return loss


def train_step(variant: str, dtype=jnp.float32):
  """(jitted train step, args): `value_and_grad` of the variant's loss and
  an SGD update (elementwise on each leaf: it moves no data)."""
  mesh = mesh1()
  params, tokens, targets, specs = train_inputs(dtype, mesh)
  loss = train_loss(variant, mesh, specs)

  def train_step(params, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value
  return jax.jit(train_step), (params, tokens, targets)


# --- attention --------------------------------------------------------------------

ATTENTION = dict(heads=8, head_dim=128, dtype=jnp.bfloat16)


def attention_inputs(seq: int, layout: str = "bshd"):
  """q, k, v, and a cotangent, batch 1, bf16; `layout` 'bshd' (ours) or
  'bhsd' (Pallas flash_attention's)."""
  h, d = ATTENTION["heads"], ATTENTION["head_dim"]
  shape = (1, seq, h, d) if layout == "bshd" else (1, h, seq, d)
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  return [jax.random.normal(k, shape, ATTENTION["dtype"]) for k in keys]


def ring_attention_fn(causal: bool = True, implementation=None):
  """ring_attention on a 1-device mesh ('cp'), (q, k, v) -> out; by default
  on TPU the library's Pallas flash kernel, with "xla" its XLA blocks."""
  from jax_overlap._src.patterns.attention.ring import ring_attention  # noqa: PLC0415
  mesh = mesh1("cp")
  spec = P(None, "cp")
  return jax.shard_map(
      lambda q, k, v: ring_attention(q, k, v, axis="cp", causal=causal,
                                     implementation=implementation),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def flash_attention_fn(block: int | None = 512, causal: bool = True):
  """jax's Pallas TPU flash_attention, (q, k, v) in (b, h, s, d) -> out;
  `block` for every block size (None: its defaults)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415
  sizes = None if block is None else fa.BlockSizes(
      block_q=block, block_k_major=block, block_k=block, block_b=1,
      block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
      block_q_dkv=block, block_k_major_dq=block, block_k_dq=block,
      block_q_dq=block)
  scale = 1.0 / np.sqrt(ATTENTION["head_dim"])
  return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal,
                                            sm_scale=scale, block_sizes=sizes)


def forward_and_backward(fn):
  """(q, k, v, ct) -> (out, dq, dk, dv): the forward pass and the vjp of a
  fixed cotangent, in one program."""
  def both(q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(ct))
  return both


def forward_only(fn):
  return lambda q, k, v, ct: fn(q, k, v)


# --- the pipeline ------------------------------------------------------------------

PIPELINE = dict(layers_a_stage=2, microbatch=4)
if SMALL:
  PIPELINE = dict(layers_a_stage=2, microbatch=2)


def _pipeline_setup(stages: int, seq: int | None = None):
  import dataclasses  # noqa: PLC0415
  from jax_overlap._src.demo import pipeline  # noqa: PLC0415
  cfg = train_config(layers=stages * PIPELINE["layers_a_stage"])
  if seq is not None:
    cfg = dataclasses.replace(cfg, seq=seq)
  mesh = jax.make_mesh((1, 1), (pipeline.PP, pipeline.FSDP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:1])
  params = pipeline.init(cfg, stages, jax.random.PRNGKey(0))
  specs = pipeline.specs(params)
  params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                        params, specs)
  return cfg, mesh, params, specs


def _stage_and_inputs(shape_of, rows, seq=None):
  """(stage(w, x) as pipelined_loss's stage on stage 0's blocks, its blocks,
  their specs, the mesh, x and a cotangent of shape `shape_of(cfg)` laid out
  as `rows`)."""
  from jax_overlap._src.demo import model, pipeline  # noqa: PLC0415
  from jax_overlap._src.patterns.fsdp.scan import fsdp_scan  # noqa: PLC0415
  cfg, mesh, params, specs = _pipeline_setup(1, seq)
  x, ct = (jax.device_put(jax.random.normal(jax.random.PRNGKey(k), shape_of(cfg)),
                          NamedSharding(mesh, rows)) for k in (2, 3))

  def stage(w, x):
    w = jax.tree.map(lambda a: a[0], w)
    return fsdp_scan(model.block(cfg), x, w, axis=pipeline.FSDP, shard_dims=1,
                     params_first=True)
  return stage, params["blocks"], specs["blocks"], mesh, x, ct


def pipeline_stage_tick():
  """(jitted, args): what one stage of the demo's pipeline computes in a
  forward and a backward tick, on one device: its `fsdp_scan` over
  `layers_a_stage` blocks (axis 'fsdp', shard_dims=1, as
  `demo.pipeline.pipelined_loss`'s stage), forward and the vjp of a
  cotangent, for one microbatch."""
  from jax_overlap._src.demo import pipeline  # noqa: PLC0415
  # Varying over both axes, as the stage's output is (its weights vary).
  rows = P((pipeline.PP, pipeline.FSDP))
  stage, blocks, block_specs, mesh, x, ct = _stage_and_inputs(
      lambda cfg: (PIPELINE["microbatch"], cfg.seq, cfg.d), rows)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(block_specs, rows, rows),
                 out_specs=(rows, block_specs, rows))
  def tick(w, x, ct):
    y, vjp = jax.vjp(stage, w, x)
    dw, dx = vjp(ct)
    return y, dw, dx
  return tick, (blocks, x, ct)


def pipeline_stage_microbatches(recompute: bool, microbatches: int = 4,
                                seq: int | None = None, batch: int | None = None):
  """(jitted, args): the gradient of one stage of the demo's pipeline over
  `microbatches` microbatches (as `pipeline_stage_tick`'s), all forwards
  first, each keeping its residuals in HBM (`recompute=False`: what
  `pipeline_loss(recompute=False)` keeps between a microbatch's F and B),
  or keeping only its input and recomputing the forward in the backward
  (`recompute=True`: `jax.checkpoint` of the stage, as
  `pipeline_loss(recompute=True)`). Its two timings say what keeping
  residuals costs against recomputing on the chip, for the model to be
  checked against. `seq`, `batch`: a microbatch's sequence length and
  sequences (the tick's by default; bench_pipeline's is 512 and 1)."""
  from jax_overlap._src.demo import pipeline  # noqa: PLC0415
  rows = P(None, (pipeline.PP, pipeline.FSDP))
  stage, blocks, block_specs, mesh, xs, cts = _stage_and_inputs(
      lambda cfg: (microbatches, batch or PIPELINE["microbatch"], cfg.seq, cfg.d),
      rows, seq)
  if recompute:
    stage = jax.checkpoint(stage)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(block_specs, rows, rows),
                 out_specs=(block_specs, rows))
  def grads(w, xs, cts):
    def loss(w, xs):
      ys = [stage(w, xs[i]) for i in range(microbatches)]
      return sum(jnp.vdot(y, cts[i]) for i, y in enumerate(ys))
    return jax.grad(loss, argnums=(0, 1))(w, xs)
  return grads, (blocks, xs, cts)
