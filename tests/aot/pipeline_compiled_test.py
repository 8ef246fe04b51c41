"""pipeline_loss on the real TPU v5e and H100 compilers, ahead of time.

4 stages x 2 data-parallel devices, m = 8: every stage-to-stage send is a
`ppermute_start` future, and each compiles to an async collective-permute
pair; each the table defers (all but 1F1B's and interleaved's warm-up and
drain sends, which the next tick needs) has compute (a gemm or fusion)
between its start and done. The 1F1B
step's temporary memory on the H100 compiler is flat in m (its buffer rows
are the schedule's live activations), GPipe's grows with m (CPU memory is
no guide: its buffer assignment does not follow the schedule)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_overlap
from compilers import target
from jax_overlap._src import _compat, quirks
from jax_overlap._src.inspection.reading.hlo_text import parse_hlo_text
from jax_overlap._src.patterns.pipeline import buffers
from jax_overlap._src.xla import tick_gate
from schedule import windows

D, BATCH, M, STAGES = 256, 64, 8, 4


def _stage(w, x):
  return jnp.tanh(x @ w["a"]) @ w["b"]


def _mse(y, t):
  return jnp.mean((y - t) ** 2)


def _compiled(name, schedule, v=1, m=M, recompute=False, width=D, batch=BATCH):
  return _compiled_once(name, schedule, v, m, recompute, width, batch)


@functools.cache
def _compiled_once(*args):
  """One compile a program: test_1f1b_temp_memory_is_flat_in_m_and_gpipe_grows's
  1F1B and GPipe at m = FEW (= M) are test_each_send_is_an_async_pair_around_compute's
  H100 programs."""
  return _lowered(*args).compile()


def _lowered(name, schedule, v=1, m=M, recompute=False, width=D, batch=BATCH):
  tgt = target(name)
  mesh = Mesh(np.array(tgt.mesh.devices).reshape(STAGES, -1), ("pp", "dp"))

  def loss(w, xs, ts):
    def body(w, xs, ts):
      l = jax_overlap.pipeline_loss(_stage, _mse, w, xs, ts, axis="pp",
                                    schedule=schedule, virtual_stages=v,
                                    recompute=recompute)
      return jax.lax.pmean(l, "dp")
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(P("pp"), P(None, "dp"), P(None, "dp")),
                         out_specs=P())(w, xs, ts)

  def sd(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=NamedSharding(mesh, spec))
  w = {n: sd((STAGES * v, width, width), P("pp")) for n in "ab"}
  xs, ts = (sd((m, batch, width), P(None, "dp")) for _ in range(2))
  return jax.jit(jax.value_and_grad(loss)).lower(w, xs, ts)


def _step_text(name, schedule, v=1, m=M):
  return _compiled(name, schedule, v, m).as_text()


def permute_windows(text):
  """(async collective-permute pairs, of them with compute between)."""
  pairs = [w for w in windows(text) if w.kind == "collective-permute"]
  computing = [w for w in pairs if any(
      i.is_matmul or i.opcode in ("fusion", "custom-call", "convolution",
                                  "conditional") for i in w.between)]
  return pairs, computing


CASES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2),
         ("dualpipev", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
@pytest.mark.parametrize("schedule,v", CASES)
def test_each_send_is_an_async_pair_around_compute(name, schedule, v):
  text = _step_text(name, schedule, v)
  pairs, computing = permute_windows(text)
  gemm = sum(w.matmuls > 0 for w in pairs)
  print(f"{name} {schedule}: {len(pairs)} async permute pairs, "
        f"{len(computing)} with compute between ({gemm} a matmul)")
  prog = buffers.program(jax_overlap.pipeline_schedule(schedule, STAGES, M, v))
  deferred = sum(s.deferred for t in prog.ticks for s in t.sends)
  assert pairs, "no async collective-permute"
  assert len(computing) >= deferred - 3   # the drain's idle ticks


#: Two microbatch counts 2x apart, both past 1F1B's warm-up (at m = p its
#: rows are not yet all in use: 1.11 MiB at m = 4, 1.61 at 16): the
#: flat-in-m tests compile each (with 2p and 8p, 22 and 70 ticks, they took
#: 69 s and 75 s in CI; 17 s each alone with 4p).
FEW, MANY = 2 * STAGES, 4 * STAGES


@pytest.mark.slow
def test_1f1b_temp_memory_is_flat_in_m_and_gpipe_grows():
  temp = {(s, m): _compiled("gpu_h100", s, m=m).memory_analysis().temp_size_in_bytes
          for s in ("1f1b", "gpipe") for m in (FEW, MANY)}
  print({k: f"{b / 2**20:.2f} MiB" for k, b in temp.items()})
  one_act = BATCH // 2 * D * 4                     # a microbatch's activation, per device
  assert temp["1f1b", MANY] <= 1.15 * temp["1f1b", FEW]
  # GPipe keeps every microbatch's stage input until its backward starts
  assert temp["gpipe", MANY] - temp["gpipe", FEW] >= (MANY - FEW) * one_act * 0.9


@pytest.mark.slow
def test_kept_residuals_are_flat_in_m_and_cost_their_rows():
  """1F1B keeping its stages' residuals (the default off TPU) against
  recomputing each stage's forward in its backward: both flat in m, keeping
  costs its rows of the stage's `tanh` output (stage 0 holds 2p - 1) in temp
  bytes, and both modelled steps are printed (docs/pipeline.md, "Memory"),
  at a size where the stage's matmuls, not the sends' latency, set the step
  (width 1024, 4096 rows a device). Since a switch tick's rows are written
  after its conditional the recomputing step is the shorter here (the
  figures: docs/pipeline.md "Memory")."""
  temp, step = {}, {}
  for recompute in (False, True):
    for m in (FEW, MANY):
      compiled = _compiled("gpu_h100", "1f1b", m=m, recompute=recompute,
                           width=1024, batch=8192)
      temp[recompute, m] = compiled.memory_analysis().temp_size_in_bytes
      step[recompute, m] = jax_overlap.OverlapReport.from_hlo(
          compiled.as_text(), hardware="h100").step_s
  print({k: f"{b / 2**20:.2f} MiB" for k, b in temp.items()})
  print({k: f"{s * 1e3:.3f} ms" for k, s in step.items()})
  for recompute in (False, True):
    assert temp[recompute, MANY] <= 1.15 * temp[recompute, FEW]
  row = 8192 // 2 * 1024 * 4            # the tanh output, a microbatch, per device
  assert temp[False, FEW] - temp[True, FEW] >= (2 * STAGES - 1) * row * 0.9


def branch_copies(text, row):
  """The copies in the branches of the module's conditionals, and of them
  those of a buffer of rows of shape `row` (dims)."""
  mod = parse_hlo_text(text)
  copies = [c for comp in mod.computations.values() for i in comp.instructions
            if i.opcode == "conditional"
            for name in i.callees("branch_computations")
            for c in mod.computations[name].instructions if c.opcode == "copy"]
  rows = [c for c in copies if not c.shape.is_tuple
          and tuple(c.shape.dims[1:]) == tuple(row) and c.shape.dims[0] > 1]
  return copies, rows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_switch_ticks_write_their_rows_after_the_conditional(name):
  """A switch tick's branches return the rows they write, not whole
  buffers, and the buffers start unfilled (row_writes.py, executor.py
  `_unset_rows`): no buffer of kept rows (stage inputs, cotangents, the
  stage's `tanh` output) is copied in a branch. Before, XLA:GPU copied the
  buffers a branch returned (this H100 module had such copies, the v5e
  module none; what they cost the bench: docs/pipeline.md "Memory")."""
  copies, rows = branch_copies(_step_text(name, "1f1b"), (BATCH // 2, D))
  print(f"{name}: {len(copies)} copies in the conditionals' branches, "
        f"{len(rows)} of a buffer of rows")
  assert not rows, [c.name for c in rows]


def _lockstep_compiled(name, inner, m=M):
  """4 stages x 2 devices of a second axis, each stage holding collectives
  over it (so pipeline_loss runs in lockstep): 'tp', a Megatron MLP with a
  psum; 'cp', ring attention over the sequence; `m` microbatches."""
  tgt = target(name)
  mesh = Mesh(np.array(tgt.mesh.devices).reshape(STAGES, -1), ("pp", inner))
  heads, hd, seq = 4, D // 4, 128

  def stage(w, x):
    if inner == "tp":
      return x + jax.lax.psum(jnp.tanh(x @ w["a"]) @ w["b"], "tp")
    b, s, _ = x.shape
    q, k, v = (jnp.reshape(x @ w[n], (b, s, heads, hd)) for n in ("a", "b", "c"))
    o = jax_overlap.ring_attention(q, k, v, axis="cp", causal=True, layout="zigzag")
    return x + jnp.reshape(o, (b, s, D))

  def loss(w, xs, ts):
    def body(w, xs, ts):
      l = jax_overlap.pipeline_loss(stage, _mse, w, xs, ts, axis="pp")
      return jax.lax.pmean(l, inner)
    data = P(None, None, "cp") if inner == "cp" else P()
    wspec = ({"a": P("pp", None, "tp"), "b": P("pp", "tp", None)} if inner == "tp"
             else P("pp"))
    return jax.shard_map(body, mesh=mesh, in_specs=(wspec, data, data),
                         out_specs=P())(w, xs, ts)

  def sd(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=NamedSharding(mesh, spec))
  if inner == "tp":
    w = {"a": sd((STAGES, D, D), P("pp", None, "tp")),
         "b": sd((STAGES, D, D), P("pp", "tp", None))}
    xs = ts = sd((m, BATCH, D), P())
  else:
    w = {n: sd((STAGES, D, D), P("pp")) for n in "abc"}
    xs = ts = sd((m, 2, seq, D), P(None, None, "cp"))
  return jax.jit(jax.value_and_grad(loss)).lower(w, xs, ts).compile().as_text()


@pytest.mark.slow
@pytest.mark.newest_jax(older_jax=[
    "test_lockstep_stages_keep_their_sends_in_flight[cp-gpu_h100]"])
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
@pytest.mark.parametrize("inner", ["tp", "cp"])
def test_lockstep_stages_keep_their_sends_in_flight(name, inner):
  """A stage holding collectives over another axis runs in lockstep (no
  switch): it compiles, and the stage-to-stage sends (and, with a ring, its
  rotations) are async pairs with compute between, all but at most the
  sends the plan itself waits for (the warm-up's and the drain's, whose
  `done` the next tick needs: 6 of 1F1B's 12 at p=4, m=4; the jax 0.10.2
  H100 compiler leaves 4 such sends bare). Both stages run 4
  microbatches, one a stage (tp: 11 of 11 pairs with compute on the H100 in
  37 s of compile, where 8 took 123 s for 20 of 20; cp: H100 30 of 33, v5e
  40 of 40, 32 s and 29 s of compile, where 8 took 196 s and 131 s in CI)."""
  text = _lockstep_compiled(name, inner, m=STAGES)
  pairs, computing = permute_windows(text)
  print(f"{name} lockstep {inner}: {len(pairs)} async permute pairs, "
        f"{len(computing)} with compute between")
  prog = buffers.program(jax_overlap.pipeline_schedule("1f1b", STAGES, STAGES))
  waited = sum(not s.deferred for t in prog.ticks for s in t.sends)
  assert pairs and len(pairs) - len(computing) <= waited


def _fsdp_stage_compiled(name, layers=2):
  """1F1B over 4 stages x 2 FSDP devices, each stage an `fsdp_scan` over its
  layers (so lockstep), compiled; the scheduled text."""
  tgt = target(name)
  mesh = Mesh(np.array(tgt.mesh.devices).reshape(STAGES, -1), ("pp", "fsdp"))

  def stage(w, x):
    return jax_overlap.fsdp_scan(lambda w, x: jnp.tanh(x @ w), x, w,
                                 axis="fsdp", shard_dims=1, params_first=True)

  def loss(w, xs, ts):
    def body(w, xs, ts):
      return jax.lax.pmean(jax_overlap.pipeline_loss(stage, _mse, w, xs, ts,
                                                     axis="pp"), "fsdp")
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(P("pp", None, "fsdp", None), P(None, "fsdp"),
                                   P(None, "fsdp")), out_specs=P())(w, xs, ts)

  def sd(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=NamedSharding(mesh, spec))
  w = sd((STAGES, layers, D, D), P("pp", None, "fsdp", None))
  xs = ts = sd((M, BATCH, D), P(None, "fsdp"))
  return jax.jit(jax.value_and_grad(loss)).lower(w, xs, ts).compile().as_text()


def _weight_gather(line, fsdp=2):
  """Whether a scheduled instruction starts an FSDP weight gather: an
  all-gather, or (jax < 0.12, row "tpu-plain-permute-gathers") a
  collective-permute whose pairs stay inside a stage's FSDP group."""
  if " all-gather-start(" in line:
    return True
  if "collective-permute-start(" not in line:
    return False
  pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
  return all(int(a) // fsdp == int(b) // fsdp for a, b in pairs)


def _entry_lines(text):
  lines = text.splitlines()
  start = next(k for k, line in enumerate(lines) if line.startswith("ENTRY"))
  end = next(k for k in range(start, len(lines)) if lines[k].startswith("}"))
  return lines[start:end]


@pytest.mark.newest_jax(older_jax=[
    "test_the_default_recomputes_on_tpu_and_keeps_residuals_on_gpu"])
@pytest.mark.parametrize("name,recomputes", [("tpu_v5e", True),
                                              ("gpu_h100", False)])
def test_the_default_recomputes_on_tpu_and_keeps_residuals_on_gpu(name,
                                                                  recomputes):
  """pipeline_loss's recompute=None follows the platform of the mesh the
  program is for: on the v5e the pipeline's residual buffers cost more than
  the recompute (the bench's 1F1B 51.1 against 33.2 ms modelled), on the
  H100 keeping them is faster. Counted in the lowered module: the stage's
  tanh runs once more a backward action where it recomputes."""
  tanhs = lambda r: _lowered(name, "1f1b", recompute=r).as_text().count(
      "stablehlo.tanh")
  default, kept, again = tanhs(None), tanhs(False), tanhs(True)
  print(f"{name}: tanh ops, default {default}, kept {kept}, recomputed {again}")
  assert again > kept
  assert default == (again if recomputes else kept)


@pytest.mark.slow
@pytest.mark.newest_jax(older_jax=[   # the row's tested range: each libtpu
    "test_lockstep_ticks_gather_their_weights_one_tick_ahead_at_most"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
def test_lockstep_ticks_gather_their_weights_one_tick_ahead_at_most(
    name, gated, monkeypatch):
  """In lockstep each tick's FSDP weight gathers need nothing but the
  parameters; the executor ties the parameters a tick reads to the loss
  the tick before starts from (quirks row "tpu-pipeline-tick-gate",
  xla/tick_gate.py), so the v5e compiler cannot start every tick's gathers
  at the program's start (it did: the bench's 1F1B held 34 to 63 gathered
  layers at its peak, temp 461 -> 3,609 MiB). Ungated (the row off), the
  installed libtpu still starts most of them there: when it no longer
  does, the row's tested range ends. Before jax 0.12 the gathers are
  plain-future permutes (row "tpu-plain-permute-gathers") that stay in
  their tick by themselves, and the row is not asked. At width 256, 1F1B
  with the default recompute (True on TPU): jax 0.12 / libtpu 0.0.52, 6 of
  32 gathers started before the first stage send with the gate, 32 of 32
  without (v5p, whose gathers are permutes: 11 of 76 with, 54 of 76
  without); jax 0.10.2 / 0.0.42.1 and 0.11.0 / 0.0.44.1, v5e, 1 of 33
  without (2 of 42 with a barrier)."""
  if not gated:
    applies = quirks.applies
    monkeypatch.setattr(quirks, "applies", lambda name, *a: (
        name != tick_gate.QUIRK and applies(name, *a)))
  entry = _entry_lines(_fsdp_stage_compiled(name))
  gathers = [k for k, line in enumerate(entry) if _weight_gather(line)]
  first_send = next(k for k, line in enumerate(entry)
                    if ("collective-permute-start(" in line
                        or "collective-permute-done(" in line)
                    and not _weight_gather(line))
  early = sum(k < first_send for k in gathers)
  print(f"{name} lockstep fsdp stage, gated={gated}: {early} of {len(gathers)} "
        "weight gathers start before the first stage send")
  assert gathers
  if gated or not _compat.ASYNC_CUSTOM_CALLS:   # older jax: never gated
    assert early <= len(gathers) // 3
  else:
    assert early > len(gathers) // 2
