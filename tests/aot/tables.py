"""The two real-compiler tables of docs/, from real compiles.

"Is the order kept in the compiled program?" (its GPU and TPU rows, in
docs/program-order.md) and "On the real TPU and GPU compilers" (the futures,
fsdp_scan and collective matmul on each target, in docs/compilers.md):
every cell is what this script reads in a scheduled module that the TPU / GPU
compiler of one aot venv made, with that venv's jaxlib, libtpu
and CUDA plugin versions beside it. Run it once per aot venv (each writes its
cells as JSON), then merge (prints both tables as markdown):

    make aot-venvs
    for v in .venv-aot .venv-aot-jax0.11.0 .venv-aot-jax0.10.2; do
      PYTHONPATH=$PWD/src $v/bin/python tests/aot/tables.py --out out/aot-cells-${v#.venv-}.json
    done
    python3 tests/aot/tables.py --merge out/aot-cells-*.json > out/aot-tables.md

then paste out/aot-tables.md's two tables into docs/: the order kept into
docs/program-order.md, the futures table into docs/compilers.md (each where
its comment marks it). Each target compiles
in a child process of its own (about 1-2 minutes a venv in all), so a compiler
that crashes costs only its own cells, which then say so. The programs are
real_compilers_test.py's (the tests check the same things; this script says
them).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).parent
TARGETS = ("tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_a100", "gpu_h100_2x8")
LABEL = {"tpu_v5e": "TPU v5e 2x4", "tpu_v5p": "TPU v5p 2x2x2",
         "gpu_h100": "GPU H100 x8", "gpu_a100": "GPU A100 x8",
         "gpu_h100_2x8": "GPU H100 2 hosts x 8"}
#: (column, program key, extra args) of the futures table.
COLUMNS = [(f"`{k}_start`", "future", (k,)) for k in
           ("all_gather", "ppermute", "psum", "psum_scatter", "all_to_all",
            "ragged_all_to_all")] + [
    ("`fsdp_scan` fwd", "fsdp", (False, True)),    # buckets on, the default
    ("`fsdp_scan` grad", "fsdp", (True, True)),
    ("`fsdp_scan` explicit, grad", "fsdp_explicit", (True,)),
    ("`all_gather_matmul` fwd / bwd", "collective_matmul", ("all_gather_matmul",)),
    ("`matmul_reduce_scatter` fwd / bwd", "collective_matmul", ("matmul_reduce_scatter",)),
    ("`expert_parallel` fwd / grad", "moe", ("capacity",)),
    ("`expert_parallel` dropless, fwd / grad", "moe", ("dropless",)),
]
#: expert_parallel's chunks in the table (the default).
MOE_CHUNKS = 2
PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin")


def versions() -> dict:
  import importlib.metadata as md  # noqa: PLC0415
  out = {}
  for p in PACKAGES:
    try:
      out[p] = md.version(p)
    except md.PackageNotFoundError:
      out[p] = None
  return out


# --- in the child: one target's cells ------------------------------------------

def _why(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  if "vhlo.async_start_v1" in text:
    return "fails: plugin refuses the async region"
  if "kExceedsOverlapLimit" in text:
    return "fails: kExceedsOverlapLimit"
  first = text.splitlines()[0]
  return "fails: " + (first[:100] + "..." if len(first) > 100 else first)


def _said(warned) -> str:
  if any("back to back" in m for m in warned):
    return "warned: back to back"
  return "warned" if warned else "NOT said"


def _hlo_kind(rt, name, kind):
  """What the future compiles to on `name`: its TPU form is an all-to-all."""
  if rt._permute_form(name, kind):
    return "collective-permute"
  if name.startswith("tpu"):
    forms = rt._V5P_FORM_KIND if name == "tpu_v5p" else rt._TPU_FORM_KIND
    return forms.get(kind, rt._HLO_KIND[kind])
  return rt._HLO_KIND[kind]


def _future_cell(rt, name, text, warned, kind):
  pairs = rt._async(text, _hlo_kind(rt, name, kind))
  if pairs and any(w.matmuls for w in pairs):
    return "async, matmul inside" + (f", {_said(warned)}" if warned else "")
  if pairs:
    return f"async, nothing inside, {_said(warned)}"
  return f"sync, {_said(warned)}"


def _behind(windows):
  return f"{sum(w.matmuls >= 1 for w in windows)}/{len(windows)}"


def _fsdp_cell(rt, name, text, warned, grad):
  # Buckets (the default): one gather and one reduce-scatter a layer (v5p:
  # each N-1 permutes, counted as one future: rt._gathers / rt._scatters).
  # Elsewhere each is one pair of the kind it compiles to (v5e's reduce-
  # scatter: its TPU form, an all-to-all). Each counted as many times as it
  # runs (a loop body's once a layer: rt._runs).
  permutes = rt._async(text, "collective-permute")
  if rt.permute_gathers(name) and permutes:
    gathers = rt._gathers(text, name)
    scatters = (rt._scatters(text, name) if name == "tpu_v5p" else
                rt._runs(text, _hlo_kind(rt, name, "psum_scatter")))
  elif name == "tpu_v5p":   # jax < 0.12 on an explicit mesh: XLA's reshards
    gathers = rt._async(text, "all-gather")
    scatters = rt._async(text, "reduce-scatter")
  else:
    gathers = rt._runs(text, _hlo_kind(rt, name, "all_gather"))
    scatters = rt._runs(text, _hlo_kind(rt, name, "psum_scatter"))
  want = (2 if grad else 1) * (rt.LAYERS - 1)
  cell = f"gathers {sum(w.matmuls >= 1 for w in gathers)}/{want}"
  if grad:
    cell += (f", scatters {sum(w.matmuls >= 1 for w in scatters)}"
             f"/{rt.LAYERS - 1}")
  return cell + (f", {_said(warned)}" if warned else "")


def _moe_cell(mc, text, warned, kind, grad):
  passes = 2 if grad else 1
  said = f", {_said(warned)}" if warned else ""
  if kind == "capacity":
    # all-to-alls with an expert matmul in flight / wanted: all of a pass's
    # but its first and last (moe_compiled_test.py)
    pairs = mc.all_to_all_windows(text)
    inside = sum(any(map(mc.is_expert_matmul, w.between)) for w in pairs)
    return f"{inside}/{MOE_CHUNKS * passes}{said}"
  ragged = len(re.findall(r" ragged-all-to-all(?:-start)?\(", text))
  beside = sum(any(map(mc.is_expert_matmul, w.between))
               for w in mc.schedule.windows(text) if w.kind == "ragged-all-to-all")
  padded = [t for t in mc._dense_all_to_alls(text) if t != "s32"]
  cell = f"ragged {ragged}, {beside} with a matmul"
  if padded:
    cell += f", {len(padded)} padded all-to-all"
  return cell + said


def child(name: str) -> None:
  """Prints one JSON line a cell for target `name`, as each is made."""
  sys.path[:0] = [str(HERE), str(HERE.parent / "support"), str(HERE.parent / "ordering")]
  import real_compilers_test as rt  # noqa: PLC0415
  import schedule_test as st  # noqa: PLC0415
  import moe_compiled_test as mc  # noqa: PLC0415
  rt.PROGRAMS.setdefault("moe", mc.moe_program)

  def say(column, cell):
    print(json.dumps({"target": name, "column": column, "cell": cell}), flush=True)

  try:
    rt.target(name)
  except BaseException as e:  # noqa: BLE001 - pytest's skip/fail outcomes included
    say("*", f"no compiler: {e}")
    return
  try:
    kept = rt.written_order_kept(name)
    n = sum(kept[c, True][0] for c in st.CASES)
    xla = sum(kept[c, False][0] for c in st.CASES)
    say("order", f"{'kept' if n == len(st.CASES) else 'NOT kept'}: {n} of "
        f"{len(st.CASES)} bodies (undecorated: {xla} of {len(st.CASES)})")
  except Exception as e:  # noqa: BLE001
    say("order", _why(e))
  for column, key, extra in COLUMNS:
    grads = (False, True) if key in ("collective_matmul", "moe") else (None,)
    cells = []
    for grad in grads:
      args = extra if grad is None else (*extra, grad)
      if key == "moe":
        args = (MOE_CHUNKS, grad, None if extra[0] == "dropless" else mc.CAPACITY)
      try:
        text, warned = rt._compiled(name, key, *args)
      except Exception as e:  # noqa: BLE001
        cells.append(_why(e))
        continue
      if key == "future":
        cells.append(_future_cell(rt, name, text, warned, extra[0]))
      elif key == "moe":
        cells.append(_moe_cell(mc, text, warned, extra[0], grad))
      elif key.startswith("fsdp"):
        cells.append(_fsdp_cell(rt, name, text, warned, extra[0]))
      else:
        permutes = rt._async(text, "collective-permute")
        cells.append(_behind(permutes) + (f", {_said(warned)}" if warned else ""))
    say(column, " / ".join(cells))


# --- in the parent ---------------------------------------------------------------

def collect(out: pathlib.Path, targets) -> None:
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  cells = []
  for name in targets:
    run = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                         capture_output=True, text=True, timeout=1200)
    got = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    cells += got
    if run.returncode:
      done = {c["column"] for c in got}
      for column in ["order"] + [c[0] for c in COLUMNS]:
        if column not in done:
          cells.append({"target": name, "column": column,
                        "cell": f"compiler crashed (exit {run.returncode})"})
    print(name, len(got), "cells", f"(exit {run.returncode})", file=sys.stderr)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"versions": versions(), "cells": cells}, indent=1))


def _tag(v: dict, platform: str) -> str:
  extra = f"libtpu {v['libtpu']}" if platform == "tpu" else f"jax-cuda12-plugin {v['jax-cuda12-plugin']}"
  return f"jaxlib {v['jaxlib']}, {extra}"


def merge(files) -> str:
  runs = [json.loads(pathlib.Path(f).read_text()) for f in files]
  runs.sort(key=lambda r: [int(p) for p in r["versions"]["jax"].split(".")])
  lines = ["### The order kept (GPU and TPU rows)", "",
           "| backend | " + " | ".join(f"jax {r['versions']['jax']}" for r in runs) + " |",
           "|---|" + "---|" * len(runs)]
  for platform, targets in (("gpu", ("gpu_h100", "gpu_h100_2x8")),
                            ("tpu", ("tpu_v5e", "tpu_v5p"))):
    row = []
    for r in runs:
      got = {(c["target"], c["column"]): c["cell"] for c in r["cells"]}
      parts = [f"{LABEL[t]}: {got.get((t, 'order'), got.get((t, '*'), 'not run'))}"
               for t in targets]
      row.append("; ".join(parts) + f" ({_tag(r['versions'], platform)})")
    lines.append(f"| {platform.upper()} | " + " | ".join(row) + " |")
  lines += ["", "### The futures, fsdp_scan and collective matmul", "",
            *textwrap.wrap("Futures under `program_order`, a matmul written between start and "
            "`done()`: *async, matmul inside* is an async pair with the matmul in "
            "its window. fsdp_scan (4 layers, 2 weights, buckets on: one gather and one reduce-scatter a layer; "
            "*grad* is `value_and_grad`): "
            "*k/n*: k gathers (reduce-scatters) with a matmul in flight, n wanted "
            "(all gathers but each pass's first layer's, all reduce-scatters but "
            "the last layer's; k can pass n, because layer 0's weights are gathered in groups cut "
            "at its matmuls, each but the first with one in flight; a loop body's counted once an iteration); on TPU v5e a psum_scatter_start is its TPU form, an all-to-all; "
            "on v5p the gathers and reduce-scatters are each N-1 permutes, counted as one (on v5e with jax < 0.12 the gathers). Collective matmul, forward / backward: async "
            "permutes with a block matmul in the window / all permutes. expert_parallel "
            "(moe_compiled_test.py's block: 2 chunks, 2 experts a device, top-2, capacity 8), forward / "
            "value_and_grad: *k/n*: k all-to-alls with an expert matmul in flight, n wanted "
            "(all of a pass's but its first and last); dropless: the ragged all-to-alls, "
            "how many have an expert matmul in flight, and any padded (non-count) "
            "all-to-all. *warned*: "
            "the library said so at compile time; *NOT said*: it did not.", 90), "",
            "| target, jax | " + " | ".join(c[0] for c in COLUMNS) + " |",
            "|---|" + "---|" * len(COLUMNS)]
  for name in TARGETS:
    for r in runs:
      got = {c["column"]: c["cell"] for c in r["cells"] if c["target"] == name}
      if not got:
        continue
      head = (f"{LABEL[name]}, jax {r['versions']['jax']} "
              f"({_tag(r['versions'], name[:3])})")
      if "*" in got:
        lines.append(f"| {head} | " + " | ".join([got["*"]] * len(COLUMNS)) + " |")
        continue
      lines.append(f"| {head} | " + " | ".join(got.get(c[0], "not run")
                                               for c in COLUMNS) + " |")
  return "\n".join(lines) + "\n"


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=pathlib.Path, help="write this venv's cells here")
  ap.add_argument("--targets", default=",".join(TARGETS))
  ap.add_argument("--merge", nargs="+", help="cell files to merge into markdown")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    child(a.child)
  elif a.merge:
    sys.stdout.write(merge(a.merge))
  elif a.out:
    collect(a.out, a.targets.split(","))
  else:
    ap.error("give --out FILE (collect) or --merge FILES")
  return 0


if __name__ == "__main__":
  sys.exit(main())
