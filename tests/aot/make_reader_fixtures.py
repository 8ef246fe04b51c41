"""Regenerates tests/fixtures/hlo/real/readers-*: scheduled modules from the
real TPU compiler of forms the inspector's readers are tested on
(tests/inspection/inspect_real_forms_test.py): a 32-layer fsdp_scan step (async
collective fusion chains, loops counted only in their conditions), nested and
stepped loops, and the demo's transformer step (async slices). Each case
writes `readers-<stem>.as_text.txt` and `readers-<stem>.after_optimizations.txt`
and `readers-versions.txt`. Run in .venv-aot:

    PYTHONPATH=$PWD/src .venv-aot/bin/python tests/aot/make_reader_fixtures.py [stem...]

(the other real fixtures: make_real_fixtures.py).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

from make_real_fixtures import compile_with_dump

HERE = pathlib.Path(__file__).parent
# What the child imports from beside tests/aot: lowered.py, schedule_test.py.
TEST_PATHS = [str(HERE.parent / d) for d in ("support", "ordering")]
OUT = HERE.parent / "fixtures" / "hlo" / "real"
#: stem -> (target, function in this file making (fn, args)).
READER_CASES = {
    "tpu_fsdp32_value_and_grad": ("tpu_v5e", "fsdp32_program"),
    "tpu_loops": ("tpu_v5e", "loops_program"),
    "tpu_demo_step": ("tpu_v5e", "demo_step_program"),
}
_CHILD = """
import sys
sys.path[:0] = [{aot!r}, *{tests!r}]
import make_reader_fixtures as mf
import real_compilers_test as rt
fn, args = getattr(mf, {function!r})(rt.target({target!r}))
open({out!r}, "w").write(rt.compiled_text(fn, *args))
"""


def fsdp32_program(t):
  """A 32-layer fsdp_scan step (width 16) on TPU: while loops counted only
  in their conditions, and async collective fusion chains."""
  import jax  # noqa: PLC0415
  import jax_overlap  # noqa: PLC0415
  import real_compilers_test as rt  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  def loss(x, ps):
    return jax_overlap.fsdp_scan(rt._layer, x, ps, axis="x").sum()[None]
  fwd = rt._smap(t, loss, (P("x"), {"a": P(None, "x"), "b": P(None, "x")}))
  w = rt.arg(t, (32, 16, 16), P(None, "x"))
  return (jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1),
          (rt.arg(t, (64, 16), P("x")), {"a": w, "b": w}))


def loops_program(t):
  """Nested scans (5 x 3) with a psum inside, and a while loop from 1 to 9
  in steps of 2 with a ppermute: trip counts from conditions, start, step
  and nesting."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import real_compilers_test as rt  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  def body(x, ws):
    def outer(c, wo):
      def inner(c2, w):
        return jnp.tanh(c2 @ w) + jax.lax.psum(c2, "x")[:1].sum(), None
      return jax.lax.scan(inner, c, wo)[0], None
    x = jax.lax.scan(outer, x, ws)[0]
    perm = [(i, (i + 1) % 8) for i in range(8)]

    def step(carry):
      i, y = carry
      return i + 2, jnp.tanh(jax.lax.ppermute(y, "x", perm) @ ws[0, 0])
    return jax.lax.while_loop(lambda c: c[0] < 9, step, (1, x))[1]
  f = rt._smap(t, body, (P("x"), P()))
  return f, (rt.arg(t, (64, 16), P("x")), rt.arg(t, (5, 3, 16, 16)))


def demo_step_program(t):
  """The demo's transformer (2 layers, d 1024, batch 4 a device), one SGD
  step of its plain-scan loss: XLA on TPU prefetches large buffers into VMEM
  in slices (`slice-start` in as_text(), `async-start` of a slice in the
  dump)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415
  from jax_overlap._src.demo import model, training  # noqa: PLC0415

  mesh = Mesh(t.mesh.devices, (training.AXIS,))
  cfg = model.Config(vocab=256, d=1024, heads=8, hidden=4096, layers=2, seq=128)
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.PRNGKey(0)))
  specs = model.specs(shapes, training.AXIS)
  params = jax.tree.map(lambda a, sp: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, sp)), shapes, specs)
  tokens = jax.ShapeDtypeStruct((4 * 8, cfg.seq), jnp.int32,
                                sharding=NamedSharding(mesh, P(training.AXIS)))
  _, plain = training.losses_for(cfg, mesh, specs)

  def step(p, tk, tg):
    value, grads = jax.value_and_grad(plain)(p, tk, tg)
    return jax.tree.map(lambda a, g: a - 1e-3 * g, p, grads), value
  return step, (params, tokens, tokens)


def main() -> int:
  OUT.mkdir(parents=True, exist_ok=True)
  chosen = [a for a in sys.argv[1:] if a in READER_CASES] or list(READER_CASES)
  for name in chosen:
    target, function = READER_CASES[name]
    stem = OUT / f"readers-{name}"
    code = _CHILD.format(aot=str(HERE), tests=TEST_PATHS, target=target,
                         function=function, out=f"{stem}.as_text.txt")
    run = compile_with_dump(code, stem)
    if run.returncode:
      print(f"{stem.name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
      return 1
  versions = subprocess.run(
      [sys.executable, "-c",
       "import importlib.metadata as m; print('\\n'.join(f'{p} {m.version(p)}' for p in "
       "('jax', 'jaxlib', 'libtpu', 'jax-cuda12-plugin', 'jax-cuda12-pjrt', "
       "'nvidia-cuda-nvcc-cu12')))"], capture_output=True, text=True)
  (OUT / "readers-versions.txt").write_text(
      "# made by tests/aot/make_reader_fixtures.py with:\n" + versions.stdout)
  return 0


if __name__ == "__main__":
  sys.exit(main())
