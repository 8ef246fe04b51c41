"""`jax-overlap demo --mesh pp=2,fsdp=2,tp=2`: examples/llama_4d.py's
Llama-style decoder trained on a mesh of the named axes, checked once against
the same model as one program. Pinned by tests/cli/demo_test.py.

The model and its plans are the example's own file, loaded from the source
checkout: the example is what a user reads and copies, so the demo runs that
file rather than a second copy of it (a wheel without examples/ says so).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

EXAMPLE = pathlib.Path(__file__).resolve().parents[4] / "examples" / "llama_4d.py"


def load_example():
  """examples/llama_4d.py as a module."""
  if not EXAMPLE.exists():
    raise FileNotFoundError(
        f"--mesh trains examples/llama_4d.py, which is in the source checkout, not "
        f"in the installed package (looked for {EXAMPLE}): run it from a clone")
  if "llama_4d" in sys.modules:
    return sys.modules["llama_4d"]
  spec = importlib.util.spec_from_file_location("llama_4d", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules["llama_4d"] = module      # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def devices_of(axes: dict) -> int:
  n = 1
  for size in axes.values():
    n *= size
  return n


def run(opts, axes: dict, tensor: str) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  example = load_example()
  say = opts.say
  t_start = time.perf_counter()
  plan = example.Plan(axes, tensor=tensor)
  cfg = example.config_for(plan)
  names = " x ".join(f"{a}={n}" for a, n in axes.items())
  say(f"jax-overlap demo --mesh: jax {jax.__version__}, {devices_of(axes)} virtual "
      f"CPU devices as {names} (examples/llama_4d.py)\n")
  params = example.init(cfg, jax.random.key(opts.seed))
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  mixture = f"{cfg.experts} experts a block" if cfg.experts else "SwiGLU MLPs"
  say(f"Model: Llama-style decoder, {cfg.layers} blocks (GQA {cfg.heads}/{cfg.kv_heads} "
      f"heads, RoPE, {mixture}), width {cfg.d}, vocab {cfg.vocab}, "
      f"{n_params / 1e3:.0f}k parameters; {_how(plan)}.")

  say("\n1. Check: the plan's loss and gradients against the model as one program "
      "(same batch, same weights, highest matmul precision)")
  tokens, targets = example.batch(cfg, jax.random.key(99), example.batch_size(plan), 16)
  with jax.default_matmul_precision("highest"):
    got = jax.jit(jax.value_and_grad(plan.loss))(plan.place(params), tokens, targets)
    want = jax.jit(jax.value_and_grad(example.loss))(params, tokens, targets)
  grads = jax.tree.leaves(plan.unstage(got[1]))
  diff = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
             for a, b in zip(grads, jax.tree.leaves(want[1])))
  same = abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0])) and diff < 1e-5
  say(f"   loss {float(got[0]):.6f} vs {float(want[0]):.6f}; largest gradient "
      f"difference {diff:.1e} of its leaf's scale: {'the same' if same else 'DIFFERENT'}")

  say(f"\n2. Training {opts.steps} steps (adam)")
  losses = example.train(plan, opts.steps, seed=opts.seed,
                         say=lambda line: say("   " + line))
  say(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
  say(f"\nDone in {time.perf_counter() - t_start:.0f} s.")
  return 0 if same else 1


def _how(plan) -> str:
  parts = []
  if "pp" in plan.axes:
    parts.append(f"pipeline_loss over 'pp' ({plan.schedule}, {plan.microbatches} "
                 "microbatches, the embedding before stage 0, the head after the last)")
  if "fsdp" in plan.axes:
    parts.append("fsdp_scan over 'fsdp' in each stage")
  if "dp" in plan.axes:
    parts.append("data parallel over 'dp'")
  if "tp" in plan.axes:
    parts.append("tensor parallel over 'tp' by " + (
        "all_gather_matmul / matmul_reduce_scatter rings" if plan.tensor == "collective"
        else "matmul_psum (the sum of each row-split matmul in chunks)"))
  if "cp" in plan.axes:
    parts.append("ring_attention over 'cp' (zigzag, causal)")
  if "ep" in plan.axes:
    parts.append("expert_parallel over 'ep'")
  return "; ".join(parts)
