"""First call of an optax training step: trace, lower and compile times.

Three ways to write one model (a BERT-like stack with dropout, stacked
layers, AdamW), each measured in a fresh subprocess so that no jax cache is
warm:

  jit      jax.jit + NamedSharding params (sharded over "d") + plain lax.scan
  smap     jax.shard_map + all_gather of each layer's weights + plain lax.scan
  fsdp     jax.shard_map + jax_overlap.fsdp_scan

Runs are interleaved (jit, smap, fsdp, jit, ...) and the medians are
compared within one run, so that other load on the machine falls on all
variants alike. Prints the medians and the ratios fsdp/jit and fsdp/smap,
and with --count the number of times each variant's step traces the layer.

  python benchmarks/bench_first_call.py --layers 4 8 --reps 3
  python benchmarks/bench_first_call.py --layers 8 --profile fsdp   # cProfile of each phase
  .venv-aot/bin/python benchmarks/bench_first_call.py --target gpu_h100 --compiler-log
  python benchmarks/bench_first_call.py --layers 2 --reps 1 --eager 3  # eager calls
  .venv-aot/bin/python benchmarks/bench_first_call.py --target tpu_v5e  # a real compiler

Results and their reading: docs/real-clients.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

VARIANTS = ("jit", "smap", "fsdp")
B, T, D, F = 16, 16, 64, 256   # batch, sequence, width, MLP width


def _worker(variant: str, n_layers: int, profile: bool,
            fsdp_kw: dict, eager: int = 0, target: str = "cpu") -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if target != "cpu":
    # The real compilers, ahead of time (tests/aot/compilers.py's targets).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "aot"))
    import compilers  # noqa: PLC0415
  import jax  # noqa: PLC0415
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import jax_overlap as jo  # noqa: PLC0415
  if os.environ.get("BENCH_NO_USE_ORDER_SPLIT") == "1":
    # An experiment, not a user's knob: layer 0 runs in the loop instead of
    # apart, split by the order its weights are used (one copy fewer).
    from jax_overlap._src.patterns.fsdp import use_order  # noqa: PLC0415
    # (for the rest of this worker process)
    contextlib.ExitStack().enter_context(use_order.layer_0_whole())

  traces = [0]

  def ln(x, s):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(v + 1e-6) * s

  def dropout(key, x, rate=0.1):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)

  def layer(w, x, key):     # the params, the carry, then the layer's key
    traces[0] += 1
    k1, k2 = jax.random.split(key)
    h = ln(x, w["ln1"])
    q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
    a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / D ** 0.5, -1)
    a = dropout(k1, a)
    x = x + jnp.einsum("bts,bsd->btd", a, v) @ w["wo"]
    h = ln(x, w["ln2"])
    return x + dropout(k2, jax.nn.gelu(h @ w["w1"]) @ w["w2"])

  if target == "cpu":
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  else:
    from jax.sharding import Mesh  # noqa: PLC0415
    mesh = Mesh(compilers.target(target).mesh.devices, ("d",))
  ks = jax.random.split(jax.random.key(0), 7)
  r = lambda k, s: jax.random.normal(k, (n_layers,) + s) * 0.05
  params = {"wq": r(ks[0], (D, D)), "wk": r(ks[1], (D, D)),
            "wv": r(ks[2], (D, D)), "wo": r(ks[3], (D, D)),
            "w1": r(ks[4], (D, F)), "w2": r(ks[5], (F, D)),
            "ln1": jnp.ones((n_layers, D)), "ln2": jnp.ones((n_layers, D))}
  dims = {k: (None if k.startswith("ln") else 1) for k in params}
  specs = {k: (P() if d is None else P(None, "d")) for k, d in dims.items()}
  x = jax.random.normal(ks[6], (B, T, D))
  if target == "cpu":
    shard = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  else:   # nothing runs: abstract arguments laid out over the target's devices
    shard = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                              sharding=NamedSharding(mesh, s))
  params = {k: shard(v, specs[k]) for k, v in params.items()}
  x = shard(x, P("d"))
  key = shard(jax.random.key(1), P())

  def stack_plain(x, full, keys):
    y, _ = lax.scan(lambda x, wk: (layer(wk[0], x, wk[1]), None), x, (full, keys),
                    unroll=int(os.environ.get("BENCH_SCAN_UNROLL", "1")))
    return y

  def loss_jit(params, x, key):
    keys = jax.random.split(key, n_layers)
    return jnp.mean(stack_plain(x, params, keys) ** 2)

  def local_loss(body):
    def loss(params, x, key):
      keys = jax.random.split(key, n_layers)
      return lax.pmean(jnp.mean(body(x, params, keys) ** 2), "d")
    return jax.shard_map(loss, mesh=mesh, in_specs=(specs, P("d"), P()),
                         out_specs=P())

  def smap_body(x, params, keys):
    full = {k: v if dims[k] is None else
            lax.all_gather(v, "d", axis=1, tiled=True)
            for k, v in params.items()}
    return stack_plain(x, full, keys)

  def fsdp_body(x, params, keys):
    return jo.fsdp_scan(layer, x, params, axis="d", shard_dims=dims, xs=keys,
                        params_first=True, **fsdp_kw)

  loss = {"jit": loss_jit, "smap": local_loss(smap_body),
          "fsdp": local_loss(fsdp_body)}[variant]
  opt = optax.adamw(1e-3)
  if target == "cpu":
    opt_state = opt.init(params)
  else:
    init = jax.jit(opt.init).lower(params).compile()
    opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(   # (a new scalar: replicated)
            a.shape, a.dtype, sharding=s if isinstance(s, NamedSharding)
            else NamedSharding(mesh, P())),
        jax.eval_shape(opt.init, params), init.output_shardings)

  def step(params, opt_state, x, key):
    value, grads = jax.value_and_grad(loss)(params, x, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  if eager:
    # Repeated eager calls (no jax.jit): value_and_grad of the shard_map loss.
    grad = jax.value_and_grad(loss)
    times = []
    for _ in range(eager):
      t0 = time.perf_counter()
      jax.block_until_ready(grad(params, x, key))
      times.append(time.perf_counter() - t0)
    return {"variant": variant, "layers": n_layers, "eager": times}

  out = {"variant": variant, "layers": n_layers}
  phases = {}

  def timed(name, fn):
    # With --profile: a cProfile of each phase (trace, lower, compile) alone.
    profiler = None
    if profile:
      import cProfile  # noqa: PLC0415
      profiler = cProfile.Profile()
      profiler.enable()
    t0 = time.perf_counter()
    result = fn()
    out[name] = time.perf_counter() - t0
    if profiler is not None:
      profiler.disable()
      phases[name] = profiler
    return result

  traced = timed("trace", lambda: jax.jit(step).trace(params, opt_state, x, key))
  lowered = timed("lower", traced.lower)
  compiled = timed("compile", lowered.compile)
  if target == "cpu":
    jax.block_until_ready(compiled(params, opt_state, x, key))
  text = lowered.as_text()
  out.update(layer_traces=traces[0],
             stablehlo_ops=sum(" = " in line for line in text.splitlines()))
  if phases:
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415
    buf = io.StringIO()
    for name, profiler in phases.items():
      buf.write(f"\n===== {name}: {out[name]:.2f} s =====\n")
      stats = pstats.Stats(profiler, stream=buf)
      stats.sort_stats("cumulative").print_stats(
          os.environ.get("BENCH_PROFILE_FILTER", ""), 45)
      stats.sort_stats("tottime").print_stats(20)
    out["profile"] = buf.getvalue()
  return out


def _run(variant: str, n_layers: int, profile: bool = False,
         fsdp_kw: str = "{}", eager: int = 0, target: str = "cpu",
         compiler_log: bool = False) -> dict:
  cmd = [sys.executable, __file__, "--worker", variant, str(n_layers),
         "--fsdp-kw", fsdp_kw, "--eager", str(eager), "--target", target]
  if profile:
    cmd.append("--profile-worker")
  env = dict(os.environ)
  if compiler_log:   # the GPU compiler's own timers, read from its log
    env.update(TF_CPP_MIN_LOG_LEVEL="0",
               TF_CPP_VMODULE="gpu_compiler=1,hlo_pass_pipeline=1")
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        env=env)
  if proc.returncode:
    raise RuntimeError(f"{variant} x{n_layers} failed:\n{proc.stderr[-4000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  if compiler_log:
    out["compiler_log"] = _compiler_timers(proc.stderr)
  return out


def _compiler_timers(log: str) -> dict:
  """{phase or pass: seconds} of the step's compile from the GPU compiler's
  log: RunHloPasses and RunBackend of jit_step, and the four slowest passes
  (each pass summed over every module and fusion it ran on)."""
  units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
  timers, passes = {}, {}
  for line in log.splitlines():
    m = re.search(r"GpuCompiler::(\w+) for jit_step time: ([\d.]+) (us|ms|s|min|h) ", line)
    if m:
      timers[m.group(1)] = float(m.group(2)) * units[m.group(3)]
    m = re.search(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s|min|h) ", line)
    if m:
      passes[m.group(1)] = passes.get(m.group(1), 0.0) + \
          float(m.group(2)) * units[m.group(3)]
  for name in sorted(passes, key=passes.get)[-4:]:
    timers[name] = passes[name]
  return {k: round(v, 1) for k, v in timers.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                  choices=VARIANTS)
  ap.add_argument("--profile", choices=VARIANTS,
                  help="print a cProfile of this variant's trace, lower and "
                  "compile, each alone")
  ap.add_argument("--fsdp-kw", default="{}",
                  help='extra fsdp_scan arguments as JSON, e.g. \'{"unroll": 1}\'')
  ap.add_argument("--eager", type=int, default=0, metavar="CALLS",
                  help="instead: CALLS eager (unjitted) value_and_grad calls "
                  "of the smap and fsdp losses; medians of all but the first")
  ap.add_argument("--target", default="cpu",
                  help="cpu (compile and run here), or a real compiler run "
                  "ahead of time: gpu_h100, tpu_v5e, ... (tests/aot/compilers.py; "
                  "needs .venv-aot)")
  ap.add_argument("--compiler-log", action="store_true",
                  help="GPU targets: also print the compiler's own timers "
                  "(RunHloPasses, RunBackend, the slowest passes) from its log")
  ap.add_argument("--profile-filter", default="",
                  help="with --profile: list only functions whose path "
                  "matches this (e.g. jax_overlap)")
  ap.add_argument("--scan-unroll", type=int, default=1,
                  help="unroll of the jit and smap variants' lax.scan (copies "
                  "of the layer in their loop, for what a copy costs)")
  ap.add_argument("--no-use-order-split", action="store_true",
                  help="experiment: fsdp_scan's layer 0 runs in the loop, not "
                  "apart (patterns/fsdp/use_order.layer_0_whole())")
  ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--profile-worker", action="store_true",
                  help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    print(json.dumps(_worker(args.worker[0], int(args.worker[1]),
                             args.profile_worker, json.loads(args.fsdp_kw),
                             args.eager, args.target)))
    return
  os.environ["BENCH_SCAN_UNROLL"] = str(args.scan_unroll)   # to the workers
  os.environ["BENCH_NO_USE_ORDER_SPLIT"] = str(int(args.no_use_order_split))
  if args.profile:
    os.environ["BENCH_PROFILE_FILTER"] = args.profile_filter   # to the worker
    for n in args.layers:
      print(_run(args.profile, n, True, args.fsdp_kw,
                 target=args.target)["profile"])
    return
  import jax  # noqa: PLC0415 - for the version line only
  print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores, 8 virtual "
        f"devices; target {args.target}; B={B} T={T} D={D} F={F}; medians of {args.reps} fresh "
        f"processes, interleaved; fsdp_scan extra arguments {args.fsdp_kw}")
  if args.eager:
    _eager_main(args)
    return
  for n in args.layers:
    runs = {v: [] for v in args.variants}
    for _ in range(args.reps):
      for v in args.variants:
        runs[v].append(_run(v, n, fsdp_kw=args.fsdp_kw, target=args.target,
                            compiler_log=args.compiler_log))
    med = {v: {k: statistics.median(r[k] for r in rs)
               for k in ("trace", "lower", "compile")}
           for v, rs in runs.items()}
    print(f"\n{n} layers        trace    lower  compile    total  layer traces"
          "  StableHLO ops")
    for v in args.variants:
      m = med[v]
      total = m["trace"] + m["lower"] + m["compile"]
      print(f"  {v:6s}    {m['trace']:7.2f}  {m['lower']:7.2f}  "
            f"{m['compile']:7.2f}  {total:7.2f}  {runs[v][0]['layer_traces']:12d}"
            f"  {runs[v][0]['stablehlo_ops']:13d}")
      if args.compiler_log:
        print(f"            compiler timers (s): {runs[v][0]['compiler_log']}")
    if "fsdp" in med:
      for base in ("jit", "smap"):
        if base not in med:
          continue
        ratio = lambda k: med["fsdp"][k] / med[base][k]
        tl = (med["fsdp"]["trace"] + med["fsdp"]["lower"]) / (
            med[base]["trace"] + med[base]["lower"])
        tot = sum(med["fsdp"].values()) / sum(med[base].values())
        print(f"  fsdp/{base}: trace+lower {tl:.2f}x, compile "
              f"{ratio('compile'):.2f}x, total {tot:.2f}x")


def _eager_main(args) -> None:
  variants = [v for v in args.variants if v != "jit"]
  for n in args.layers:
    runs = {v: [] for v in variants}
    for _ in range(args.reps):
      for v in variants:
        runs[v].append(_run(v, n, fsdp_kw=args.fsdp_kw, eager=args.eager))
    print(f"\n{n} layers, eager value_and_grad: first call, then the median "
          "of the later calls (s)")
    first = {v: statistics.median(r["eager"][0] for r in rs)
             for v, rs in runs.items()}
    later = {v: statistics.median(t for r in rs for t in r["eager"][1:])
             for v, rs in runs.items()}
    for v in variants:
      print(f"  {v:6s}  first {first[v]:7.2f}  later {later[v]:7.2f}")
    if "fsdp" in later and "smap" in later:
      print(f"  fsdp/smap: first {first['fsdp'] / first['smap']:.2f}x, later "
            f"{later['fsdp'] / later['smap']:.2f}x")


if __name__ == "__main__":
  main()
