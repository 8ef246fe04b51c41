"""Dumps the compiled text of a set of `fsdp_scan` programs, and compares two dumps.

For a change to fsdp_scan's engine that must not change what it builds:
dump before, dump after, compare. Each program (the settings in PROGRAMS:
grad and value_and_grad; bucket on/off; prefetch 1-3; reshard_after_forward
True/False/int; unroll; before/after; xs=; has_ys; remat_policy; HSDP; an
explicit mesh; a layer closing over a traced value) is compiled for each
target: "cpu" (8 CPU devices), "tpu_v5e" (v5e 2x4, ahead of time) and
"gpu_h100" (8 H100s, ahead of time; both need the compilers' wheels, as in
tests/aot). Written per program: the jaxpr, the compiled text
(`jit(f).lower(*args).compile().as_text()`), or the error.

  python tools/fsdp_compiled_texts.py dump DIR [--targets cpu tpu_v5e gpu_h100]
      [--programs NAME ...]
  python tools/fsdp_compiled_texts.py compare DIR_A DIR_B

`compare` reads each text with the source locations in its metadata
removed (`source_file`, `source_line`, ...: a moved line of our code changes
them, nothing else); the op names (the scopes that name the plan's steps
for the report) are compared as they are. It prints, per file, "same" or
the first lines that differ, and exits 1 if any differ.
Run with PYTHONPATH=src in the interpreter whose jax (and compilers) you
want, e.g. .venv-aot for all three targets.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

N_LAYERS, WIDTH, ROWS = 4, 32, 8   # rows a device


def _settings():
  import jax  # noqa: PLC0415
  nothing = jax.checkpoint_policies.nothing_saveable
  return {
      "forward": dict(grad=None),
      "grad": dict(grad="grad"),
      "vg": dict(),
      "vg_nobucket": dict(kw=dict(bucket=False)),
      "vg_prefetch2": dict(kw=dict(prefetch=2)),
      "vg_prefetch3_keepall": dict(kw=dict(prefetch=3, reshard_after_forward=False)),
      "vg_reshard_true": dict(kw=dict(reshard_after_forward=True)),
      "vg_reshard_false": dict(kw=dict(reshard_after_forward=False)),
      "vg_reshard_2": dict(kw=dict(reshard_after_forward=2)),
      "vg_reshard_true_prefetch2_nobucket": dict(
          kw=dict(reshard_after_forward=True, prefetch=2, bucket=False)),
      "vg_unroll2": dict(kw=dict(unroll=2)),
      "vg_unroll3": dict(kw=dict(unroll=3)),
      "vg_prefetch2_unroll4": dict(kw=dict(prefetch=2, unroll=4)),
      "vg_ends": dict(ends=True),
      "vg_ends_reshard_true": dict(ends=True, kw=dict(reshard_after_forward=True)),
      "vg_ends_prefetch2_keep2": dict(ends=True, kw=dict(prefetch=2,
                                                         reshard_after_forward=2)),
      "vg_before_only": dict(ends="before"),
      "vg_after_only": dict(ends="after"),
      "vg_xs": dict(xs=True),
      "vg_xs_ends": dict(xs=True, ends=True),
      "vg_has_ys": dict(has_ys=True),
      "vg_has_ys_ends": dict(has_ys=True, ends=True),
      "vg_remat": dict(kw=dict(remat_policy=nothing)),
      "vg_remat_prefetch2": dict(kw=dict(remat_policy=nothing, prefetch=2)),
      "vg_hsdp": dict(hsdp=True),
      "vg_hsdp_prefetch2_keep2": dict(hsdp=True, kw=dict(prefetch=2,
                                                         reshard_after_forward=2)),
      "vg_hsdp_ends": dict(hsdp=True, ends=True),
      "vg_hoisted": dict(hoisted=True),
      "vg_param_dtype": dict(kw=dict(param_dtype="bfloat16")),
      "vg_1layer": dict(n=1),
      "vg_2layers": dict(n=2),
      "vg_2layers_ends": dict(n=2, ends=True),
      "vg_explicit": dict(explicit=True),
      "grad_explicit_keep2": dict(explicit=True, grad="grad",
                                  kw=dict(reshard_after_forward=2)),
      "vg_before_only_hoisted": dict(ends="before", hoisted=True),
      "vg_remat_ends": dict(ends=True, kw=dict(remat_policy=nothing)),
      "forward_ends": dict(grad=None, ends=True),
      "forward_prefetch2_keep2": dict(grad=None, kw=dict(
          prefetch=2, reshard_after_forward=2)),
      "forward_reshard_true": dict(grad=None, kw=dict(reshard_after_forward=True)),
  }


def _layer(x, p):
  import jax.numpy as jnp  # noqa: PLC0415
  h = jnp.tanh(x @ p["a"])
  return x + jnp.tanh(h @ p["b"]) * p["s"]


def program(target: str, name: str):
  """(fn, args, mesh context or None) of program `name` on `target`."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import jax_overlap  # noqa: PLC0415
  s = _settings()[name]
  n = s.get("n", N_LAYERS)
  kw = dict(s.get("kw", {}))
  if kw.get("param_dtype") == "bfloat16":
    kw["param_dtype"] = jnp.bfloat16
  devices = _devices(target)
  hsdp, explicit = s.get("hsdp", False), s.get("explicit", False)
  if hsdp:
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("r", "x"))
    batch = ("r", "x")
    kw["replica_axis"] = "r"
  elif explicit:
    mesh = jax.sharding.Mesh(np.array(devices), ("x",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    batch = "x"
  else:
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    batch = "x"
  arg = lambda shape, spec, dtype=jnp.float32: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec))
  wspec = {"a": P(None, "x"), "b": P(None, "x"), "s": P()}
  ws = {"a": arg((n, WIDTH, WIDTH), wspec["a"]),
        "b": arg((n, WIDTH, WIDTH), wspec["b"]),
        "s": arg((n, WIDTH), P())}
  x = arg((ROWS * len(devices), WIDTH), P(batch))
  emb, head = arg((WIDTH, WIDTH), P()), arg((WIDTH, WIDTH), P())
  xs = {"scale": arg((n,), P()), "key": arg((n, 2), P(), jnp.uint32)}

  def xs_layer(x, p, xs_i):
    keep = jax.random.bernoulli(jax.random.wrap_key_data(xs_i["key"]), 0.9,
                                x.shape)
    return _layer(x * jnp.where(keep, 1.0, 0.0), p) * xs_i["scale"]

  def loss(x, ps, emb, head, xs):
    layer = xs_layer if s.get("xs") else _layer
    if s.get("hoisted"):
      base = layer
      layer = lambda x, p: base(x, p) + 0.1 * jnp.tanh(x @ emb)
    if s.get("has_ys"):
      inner = layer
      layer = lambda x, *a: (lambda y: (y, jnp.mean(y ** 2)))(inner(x, *a))
    ends = s.get("ends")
    before = (lambda x: jnp.tanh(x @ emb)) if ends in (True, "before") else None
    after = (lambda y: jnp.tanh(y @ head).sum()) if ends in (True, "after") \
        else None
    extra = dict(kw)
    if s.get("xs"):
      extra["xs"] = xs
    out = jax_overlap.fsdp_scan(layer, x, ps, axis="x", before=before,
                                after=after, has_ys=s.get("has_ys", False),
                                **extra)
    if s.get("has_ys"):
      y, ys = out
      total = (y if after else y.sum()) + ys.sum()
    else:
      total = out if after else out.sum()
    return total

  if explicit:
    def f(x, ps, emb, head, xs):
      return loss(x, ps, emb, head, xs)
  else:
    specs = (P(batch), wspec, P(), P(), {"scale": P(), "key": P()})
    axes = ("r", "x") if hsdp else "x"
    f = jax.shard_map(lambda *a: jax.lax.psum(loss(*a), axes)[None],
                      mesh=mesh, in_specs=specs, out_specs=P())
  g = f
  grad = s.get("grad", "vg")
  scalar = (lambda *a: f(*a)) if explicit else (lambda *a: f(*a).sum())
  if grad == "grad":
    g = jax.grad(scalar, argnums=(0, 1, 2, 3))
  elif grad == "vg":
    g = jax.value_and_grad(scalar, argnums=(0, 1, 2, 3))
  return g, (x, ws, emb, head, xs), (mesh if explicit else None)


def _devices(target: str):
  import jax  # noqa: PLC0415
  if target == "cpu":
    return jax.devices("cpu")[:8]
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]
                         / "tests" / "aot"))
  import compilers  # noqa: PLC0415
  return list(compilers._topology(target).devices)


def dump(out: pathlib.Path, targets, names):
  import jax  # noqa: PLC0415
  jax.config.update("jax_num_cpu_devices", 8)
  for target in targets:
    where = out / target
    where.mkdir(parents=True, exist_ok=True)
    for name in names:
      try:
        fn, args, mesh = program(target, name)
        ctx = _null() if mesh is None else (
            jax.set_mesh(mesh) if hasattr(jax, "set_mesh")
            else jax.sharding.use_mesh(mesh))
        with ctx:
          jaxpr = str(jax.make_jaxpr(fn)(*args))
          text = jax.jit(fn).lower(*args).compile().as_text()
        (where / f"{name}.jaxpr.txt").write_text(jaxpr)
        (where / f"{name}.compiled.txt").write_text(text)
        print(f"{target} {name}: {len(text.splitlines())} lines", flush=True)
      except Exception as e:  # noqa: BLE001 - the error is what is compared
        (where / f"{name}.error.txt").write_text(
            f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        print(f"{target} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


_LOCATION = re.compile(
    r' (?:source_file|source_line|source_end_line|source_column|'
    r'source_end_column|stack_frame_id)=(?:"[^"]*"|\d+)')


_FILE_LOCATION = re.compile(r" (?:end_)?(?:line|column)=\d+")


def normalize(text: str) -> list[str]:
  """The text's lines without source locations: those in each
  instruction's metadata, and the line numbers in the module's table of
  file locations."""
  return [_FILE_LOCATION.sub("", line) if "file_name_id=" in line
          else _LOCATION.sub("", line) for line in text.splitlines()]


def compare(a: pathlib.Path, b: pathlib.Path) -> int:
  differ = 0
  files = sorted({p.relative_to(a) for p in a.rglob("*.txt")}
                 | {p.relative_to(b) for p in b.rglob("*.txt")})
  for rel in files:
    pa, pb = a / rel, b / rel
    if not (pa.exists() and pb.exists()):
      print(f"{rel}: only in {a if pa.exists() else b}")
      differ += 1
      continue
    if rel.name.endswith(".error.txt"):
      la = pa.read_text().split("\n\n")[0].splitlines()
      lb = pb.read_text().split("\n\n")[0].splitlines()
    else:
      la, lb = normalize(pa.read_text()), normalize(pb.read_text())
    if la == lb:
      print(f"{rel}: same ({len(la)} lines)")
      continue
    differ += 1
    diff = list(difflib.unified_diff(la, lb, str(pa), str(pb), n=0,
                                     lineterm=""))
    print(f"{rel}: DIFFERS ({len(diff)} diff lines)")
    print("\n".join(line[:400] for line in diff[:20]))
  print(f"{len(files) - differ} same, {differ} differ")
  return 1 if differ else 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  d = sub.add_parser("dump")
  d.add_argument("out", type=pathlib.Path)
  d.add_argument("--targets", nargs="+", default=["cpu", "tpu_v5e", "gpu_h100"])
  d.add_argument("--programs", nargs="+", default=None)
  c = sub.add_parser("compare")
  c.add_argument("a", type=pathlib.Path)
  c.add_argument("b", type=pathlib.Path)
  opts = parser.parse_args()
  if opts.command == "dump":
    dump(opts.out, opts.targets, opts.programs or list(_settings()))
    return 0
  return compare(opts.a, opts.b)


if __name__ == "__main__":
  sys.exit(main())
