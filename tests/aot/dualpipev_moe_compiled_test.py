"""DualPipeV with an `expert_parallel` MoE block in each stage, on the real
TPU v5e and H100 compilers, ahead of time.

p=2 on 'pp' x 4 on 'ep' (the topology's 8 devices), m=4 (DualPipeV's least,
2p), capacity 8, chunks 2: the stage holds all-to-alls over 'ep', so the
pipeline runs in lockstep, and its F&B ticks (`Pair` cells) run a forward
and a backward of different microbatches, each with its MoE all-to-alls.
The executor names the two parts' compute `pair_forward` and
`pair_backward` (pair_fences.py `scope`) and zips them at their futures
(ordering/interleave.py): each all-to-all of one part has the other part's
compute in its window, one all-to-all in flight at a time.

What holds (`test_each_all_to_all_has_the_other_parts_matmul_in_flight`):
on both compilers, with `pipeline_loss`'s defaults, all 32 Pair-tick
all-to-alls have the other part's matmul in flight (H100 10 of 32, v5e 1
of 48 before the zip). The v5e's default recomputes the stage's forward in
the backward keeping what its all-to-alls received
(`all_to_alls_saveable`): 4 all-to-alls a tick each part. With
`recompute=True` the backward exchanges again, 8 a tick to the forward's 4,
and the forward's 6 matmuls a tick leave 5 of them without one (27 of 32).
Nothing of a Pair's backward waits for its forward's all-to-alls on the
v5e (`test_a_pairs_backward_does_not_wait_for_its_forward`).
docs/pipeline.md, "DualPipeV", has the numbers. One compile a case
(H100 ~30 s, v5e ~25 s each on a shared 2-core machine).
"""

from __future__ import annotations

import functools
import re

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import schedule
from compilers import target

import jax_overlap
from jax_overlap._src import _compat

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")]

STAGES, M, T, D, H, LOCAL, K, CAPACITY = 2, 4, 16, 16, 32, 2, 2, 8


def _expert(p, tokens):
  return jnp.tanh(tokens @ p["w_in"]) @ p["w_out"]


def _stage(w, x):
  h = jnp.tanh(x @ w["a"])
  top, ids = jax.lax.top_k(h @ w["r"], K)
  y, _ = jax_overlap.expert_parallel(
      _expert, h, ids, jax.nn.softmax(top, axis=-1),
      {"w_in": w["e_in"], "w_out": w["e_out"]}, axis="ep", capacity=CAPACITY,
      chunks=2)
  return x + y


@functools.cache
def _compiled(name: str, recompute=None) -> str:
  tgt = target(name)
  mesh = Mesh(np.array(tgt.mesh.devices).reshape(STAGES, -1), ("pp", "ep"))
  ep = mesh.shape["ep"]
  specs = {"a": P("pp"), "r": P("pp"), "e_in": P("pp", "ep"),
           "e_out": P("pp", "ep")}

  def loss(w, xs, ts):
    def body(w, xs, ts):
      l = jax_overlap.pipeline_loss(
          _stage, lambda y, t: jnp.mean((y - t) ** 2), w, xs, ts, axis="pp",
          schedule="dualpipev", virtual_stages=2, recompute=recompute)
      return jax.lax.pmean(l, "ep")
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(specs, P(None, "ep"), P(None, "ep")),
                         out_specs=P())(w, xs, ts)

  def sd(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=NamedSharding(mesh, spec))
  s, e = 2 * STAGES, LOCAL * ep
  w = {"a": sd((s, D, D), specs["a"]), "r": sd((s, D, e), specs["r"]),
       "e_in": sd((s, e, D, H), specs["e_in"]),
       "e_out": sd((s, e, H, D), specs["e_out"])}
  xs = sd((M, ep * T, D), P(None, "ep"))
  return jax.jit(jax.value_and_grad(loss)).lower(w, xs, xs).compile().as_text()


def _part(line: str):
  """(tick, "F" / "B" / None) of an instruction, from its op_name."""
  name = re.search(r'op_name="([^"]*)"', line)
  name = name.group(1) if name else ""
  tick = re.search(r"pipeline_tick_(\d+)/", name)
  part = ("F" if "pair_forward" in name else
          "B" if "pair_backward" in name else None)
  return (int(tick.group(1)) if tick else None), part


def _pair_windows(text):
  """The Pair ticks' async all-to-alls: (tick, part, window)."""
  entry = schedule.scheduled(text)["ENTRY"]
  out = []
  for w in schedule.windows(text):
    if w.kind != "all-to-all" or w.computation != "ENTRY":
      continue
    tick, part = _part(entry[w.start].line)
    if part is not None:
      out.append((tick, part, w))
  return out


def _other_matmuls(tick, part, window):
  return [i for i in window.between if i.is_matmul
          and _part(i.line) == (tick, "B" if part == "F" else "F")]


def test_a_pairs_backward_does_not_wait_for_its_forward():
  """On the v5e (the H100's multi-output fusion merges elementwise pieces of
  the two parts that share an operand, so there some backward matmuls wait
  on the forward's residual add: 2 in one tick)."""
  text = _compiled("tpu_v5e")
  entry = schedule.scheduled(text)["ENTRY"]
  pairs = _pair_windows(text)
  assert len(pairs) >= 16, len(pairs)       # Pair ticks with MoE exchanges
  assert not [i for i in entry if "all-to-all" in i.opcode
              and "start" not in i.opcode and "done" not in i.opcode], \
      "a synchronous all-to-all"
  users: dict[str, list] = {}
  for i in entry:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  for tick in sorted({t for t, _, _ in pairs}):
    # everything computed from the forward part's all-to-all results
    todo = [entry[w.done] for t, p, w in pairs if t == tick and p == "F"]
    seen = set()
    while todo:
      i = todo.pop()
      if i.name in seen:
        continue
      seen.add(i.name)
      todo += users.get(i.name, [])
    # The backward's matmuls and all-to-alls; not a write of its result
    # into a buffer the forward wrote too (a local send: the v5e fuses the
    # last matmul into that dynamic-update-slice).
    waits = [i.name for i in entry if i.name in seen and _part(i.line) == (tick, "B")
             and (i.is_matmul or "all-to-all" in i.opcode)
             and "dynamic-update-slice" not in i.name]
    assert not waits, (tick, waits[:5])


#: Pair-tick all-to-alls with the other part's matmul in flight, of all,
#: per part (forward "F", backward "B"), measured with the zip (jax
#: 0.12.0.1, libtpu 0.0.52, cuda plugin 0.12.0.1).
#: None: the defaults (H100: residuals kept; v5e: `all_to_alls_saveable`);
#: False: residuals kept; True: the backward runs the whole forward again,
#: its all-to-alls too.
MEASURED = {("gpu_h100", None): {"F": (16, 16), "B": (16, 16)},
            ("tpu_v5e", None): {"F": (16, 16), "B": (16, 16)},
            ("tpu_v5e", False): {"F": (16, 16), "B": (16, 16)},
            ("tpu_v5e", True): {"F": (16, 16), "B": (27, 32)}}


@pytest.mark.parametrize("name,recompute", list(MEASURED),
                         ids=["gpu_h100", "tpu_v5e", "tpu_v5e-kept",
                              "tpu_v5e-recompute"])
def test_each_all_to_all_has_the_other_parts_matmul_in_flight(name, recompute):
  pairs = _pair_windows(_compiled(name, recompute))
  for part in ("F", "B"):
    mine = [(t, p, w) for t, p, w in pairs if p == part]
    hidden = [(t, p) for t, p, w in mine if _other_matmuls(t, p, w)]
    print(f"{name} {part}: {len(hidden)} of {len(mine)} Pair-tick "
          f"all-to-alls with the other part's matmul in flight")
    want, total = MEASURED[name, recompute][part]
    assert len(mine) == total, (part, len(mine))
    assert len(hidden) >= want, (part, len(hidden), total)
