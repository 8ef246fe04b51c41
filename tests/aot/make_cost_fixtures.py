"""Regenerates tests/fixtures/hlo/costs/: matmuls as the real TPU compiler
writes them, with the flops they really do, for the cost model's tests.

XLA:TPU writes batched matmuls (attention's einsums) as `convolution`s whose
window puts the batch on spatial dimensions (`window={size=4x8 stride=3x7
lhs_dilate=4x8}`), and their gradients as padded, reversed windows; the cost
model must count such a convolution as the batched matmul it is
(model/convolution.py). Each program here is one einsum (or an attention
layer's forward and backward), compiled ahead of time for TPU v5e (2x4, its
inputs replicated: each chip does the whole program), and
`expected.json` holds the flops the program does by its einsums alone:
2 * (product of every index's size) for each einsum, three einsums' worth
for one differentiated in both operands. A program is written with
`precision=` where it says so, and its file keeps what XLA made of it.

Run it in the aot venv:

    PYTHONPATH=$PWD/src .venv-aot/bin/python tests/aot/make_cost_fixtures.py

tests/inspection/convolution_flops_test.py reads the files (no compiler
needed there).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
import compilers  # noqa: E402  (sets JAX_PLATFORMS=cpu first)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

OUT = HERE.parent / "fixtures" / "hlo" / "costs"
TARGET = "tpu_v5e"

#: name -> (einsum, operand shapes by index letter, dtype, precision,
#: differentiated in both operands?)
PROGRAMS = {
    "scores_bf16": ("bqhd,bkhd->bhqk", dict(b=4, q=512, k=512, h=8, d=128),
                    "bfloat16", None, False),
    "scores_f32": ("bqhd,bkhd->bhqk", dict(b=4, q=512, k=512, h=8, d=128),
                   "float32", None, False),
    "mix_bf16": ("bhqk,bkhd->bqhd", dict(b=4, q=512, k=512, h=8, d=128),
                 "bfloat16", None, False),
    "scores_odd_batch": ("bqhd,bkhd->bhqk", dict(b=3, q=256, k=384, h=5, d=64),
                         "bfloat16", None, False),
    "heads_16": ("bqhd,bkhd->bhqk", dict(b=16, q=128, k=128, h=16, d=128),
                 "float32", None, False),
    "batched_matmul": ("bij,bjk->bik", dict(b=32, i=256, j=512, k=256),
                       "bfloat16", None, False),
    "projection": ("bsd,df->bsf", dict(b=8, s=512, d=1024, f=4096),
                   "bfloat16", None, False),
    "scores_highest": ("bqhd,bkhd->bhqk", dict(b=4, q=512, k=512, h=8, d=128),
                       "float32", "highest", False),
    "scores_grad": ("bqhd,bkhd->bhqk", dict(b=4, q=256, k=256, h=8, d=128),
                    "float32", None, True),
    "mix_grad": ("bhqk,bkhd->bqhd", dict(b=4, q=256, k=256, h=8, d=128),
                 "bfloat16", None, True),
}


def einsum_flops(spec: str, sizes: dict[str, int]) -> int:
  """2 * the product of every index's size (each index once)."""
  letters = set(spec.replace(",", "").replace("->", ""))
  return 2 * math.prod(sizes[c] for c in letters)


def program(spec, sizes, dtype, precision, grad):
  ins = spec.split("->")[0].split(",")
  shapes = [tuple(sizes[c] for c in s) for s in ins]

  def f(a, b):
    return jnp.einsum(spec, a, b, precision=precision)
  # sin: the gradient needs the forward's result, so all three einsums run.
  fn = (jax.grad(lambda a, b: jnp.sin(f(a, b).astype(jnp.float32)).sum(),
                 (0, 1)) if grad else f)
  return fn, shapes


def main() -> int:
  missing = compilers._missing("tpu")
  if missing:
    print(f"cannot make the fixtures: {missing}", file=sys.stderr)
    return 1
  from compilers import NamedSharding, P, _topology  # noqa: PLC0415
  mesh = jax.sharding.Mesh(list(_topology(TARGET).devices), ("x",))
  OUT.mkdir(parents=True, exist_ok=True)
  expected = {"made_by": "tests/aot/make_cost_fixtures.py",
              "versions": {p: md.version(p) for p in ("jax", "libtpu")},
              "target": f"{TARGET} (inputs replicated)", "flops": {}}
  for name, (spec, sizes, dtype, precision, grad) in PROGRAMS.items():
    fn, shapes = program(spec, sizes, dtype, precision, grad)
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype),
                                 sharding=NamedSharding(mesh, P()))
            for s in shapes]
    text = jax.jit(fn).lower(*args).compile().as_text()
    (OUT / f"{TARGET}-{name}.as_text.txt").write_text(text)
    flops = einsum_flops(spec, sizes) * (3 if grad else 1)
    expected["flops"][name] = {"einsum": spec, "sizes": sizes, "dtype": dtype,
                               "precision": precision or "default",
                               "grad": grad, "flops": flops}
    print(name, flops)
  (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
