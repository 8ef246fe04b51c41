"""Runs public entry points as the first jax_overlap call of a process
(fresh_process_test.py; not a test module itself).

  python fresh_process_worker.py OUT_DIR [--no-fork] CASE [CASE ...]

CASE is ENTRY@CONTEXT (see ENTRIES and CONTEXTS; importing this module
only defines them). This process imports jax,
numpy and jax_overlap, sets 8 CPU devices, and calls nothing else: no backend
is started, no jax_overlap function has run, nothing is cached. Then each
case runs in a process of its own, forked from this one (two at a time),
whose first jax_overlap call is the case's entry point, made in the case's
context; with --no-fork the single CASE runs in this process instead (a
process started from nothing). Each case writes OUT_DIR/CASE.json:
{"ok": bool, "error": traceback or "", "checks": [names compared with plain
jax]}. A case that spends more than CASE_CPU_S of CPU time, or stays past
CASE_WALL_S without ending, is killed and reported as a hang (CPU time, as a
case's cost: under a loaded CI machine the wall time of an 8 CPU-second case
reached 186 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time
import traceback
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap as jo  # noqa: E402  (imported only: nothing called yet)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))
from ragged_reference import dense_reference  # noqa: E402  (jax ops only)
from value_and_grads import with_grads  # noqa: E402  (jax ops only)

CASE_CPU_S = 120
CASE_WALL_S = 1200
AT_ONCE = 2
AXIS = "i"
PERM = [(k, (k + 1) % 8) for k in range(8)]

# --- contexts ------------------------------------------------------------------
# "none": no mesh context; shard_map is given the mesh (jax's default axis
# types), inputs are put on it. "explicit" / "auto": inside
# `jax.set_mesh(mesh)` with Explicit / Auto axes; shard_map takes the mesh from
# the context, as a user under set_mesh writes it.
CONTEXTS = ("none", "explicit", "auto")


def _mesh(context, n=8):
  devices = jax.devices()[:n]
  if context == "none":
    return jax.make_mesh((n,), (AXIS,), devices=devices)
  kind = {"explicit": jax.sharding.AxisType.Explicit,
          "auto": jax.sharding.AxisType.Auto}[context]
  return jax.make_mesh((n,), (AXIS,), axis_types=(kind,), devices=devices)


def _context(context, mesh):
  return contextlib.nullcontext() if context == "none" else jax.set_mesh(mesh)


def _shard_map(context, mesh, f, **kwargs):
  if context == "none":
    kwargs["mesh"] = mesh
  return jax.shard_map(f, **kwargs)


def _put(mesh, array, spec):
  return jax.device_put(array, NamedSharding(mesh, spec))


def _close(name, got, want, checks, rtol=2e-5, atol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    np.testing.assert_allclose(a, b, rtol=rtol,
                               atol=atol * (float(np.abs(b).max()) or 1.0),
                               err_msg=name)
  checks.append(name)


def _x(shape=(16, 8), seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# --- entry points ------------------------------------------------------------------
# Each takes (context, mesh, checks): it makes its entry point the first
# jax_overlap call, then compares with the same program in plain jax.

def _program_order(enforce):
  def run(context, mesh, checks):
    def f(x, w):
      a = jnp.sin(x * 2.0)
      b = jnp.tanh(a @ w)
      return b * x + a
    if enforce:
      program = jo.program_order(enforce=True)(f)              # first call
    else:
      free = jo.program_order(enforce=False)(f)                # first call
      program = jo.program_order(enforce=True)(
          lambda x, w: free(x, w) * 0.5 + x)
      f = (lambda g: lambda x, w: g(x, w) * 0.5 + x)(f)
    x, w = _x(), _x((8, 8), 1)
    with _context(context, mesh):
      if context != "none":              # the user's arrays live on the mesh
        x, w = _put(mesh, x, P(AXIS)), _put(mesh, w, P())
      loss = lambda out: jnp.sum(out ** 2)
      got = with_grads(program, loss, (0, 1))(x, w)           # compiled here
      want = with_grads(f, loss, (0, 1))(x, w)
    _close("value and grads", got, want, checks)
  return run


_FUTURES = {
    "all_gather_start": (lambda v: jo.all_gather_start(v, AXIS, tiled=True),
                         lambda v: lax.all_gather(v, AXIS, tiled=True), P(AXIS)),
    "psum_start": (lambda v: jo.psum_start(v, AXIS),
                   lambda v: lax.psum(v, AXIS), P()),
    "psum_scatter_start": (
        lambda v: jo.psum_scatter_start(v, AXIS, tiled=True),
        lambda v: lax.psum_scatter(v, AXIS, tiled=True), P(AXIS)),
    "all_to_all_start": (
        lambda v: jo.all_to_all_start(v, AXIS, 0, 0, tiled=True),
        lambda v: lax.all_to_all(v, AXIS, 0, 0, tiled=True), P(AXIS)),
    "ppermute_start": (lambda v: jo.ppermute_start(v, AXIS, PERM),
                       lambda v: lax.ppermute(v, AXIS, PERM), P(AXIS)),
    # XLA:CPU cannot run lax.ragged_all_to_all: the reference is by hand.
    "ragged_all_to_all_start": (
        lambda v: jo.ragged_all_to_all_start(v, 0.5 * v, *_ragged_ints(v),
                                             axis_name=AXIS),
        lambda v: dense_reference(v, 0.5 * v, *_ragged_ints(v)[:3], AXIS),
        P(AXIS)),
}


def _ragged_ints(v):
  """Device d sends row k to device (d + k) % 8 (one row each), received at
  row (7 - its sender): (input_offsets, send_sizes, output_offsets,
  recv_sizes)."""
  d = lax.axis_index(AXIS)
  k = jnp.arange(8, dtype=jnp.int32)
  in_off = (k - d) % 8                 # chunk k (to device k): that row
  ones = jnp.ones(8, jnp.int32)
  return in_off, ones, (7 - d) * ones, ones


def _future(name):
  start, plain, out_spec = _FUTURES[name]

  def run(context, mesh, checks):
    def body(collective):
      def f(v):
        fut = collective(v)
        side = jnp.tanh(v @ v.T) @ v       # written while the collective runs
        y = fut.done() if collective is start else fut
        return y * jnp.cos(y), side
      return _shard_map(context, mesh, f, in_specs=P(AXIS),
                        out_specs=(out_spec, P(AXIS)))
    loss = lambda out: sum(jnp.sum(t ** 2) for t in out)
    with _context(context, mesh):
      x = _put(mesh, _x((64, 8)), P(AXIS))
      got = with_grads(body(start), loss)(x)                    # first call
      want = with_grads(body(plain), loss)(x)
    _close("value and grad", got, want, checks)
  return run


def _pvary(context, mesh, checks):
  """pvary_start on a replicated scale beside a varying x (P(AXIS)): the
  same as jax's implicit cast, value and both gradients."""
  def body(cast):
    def f(v, scale):
      fut = cast(scale)
      side = jnp.tanh(v @ v.T) @ v       # written while the future is open
      s = fut.done() if cast is not _implicit else fut
      return v * s, side
    return _shard_map(context, mesh, f, in_specs=(P(AXIS), P()),
                      out_specs=(P(AXIS), P(AXIS)))
  loss = lambda out: sum(jnp.sum(t ** 2) for t in out)
  start = lambda s: jo.pvary_start(s, AXIS)
  with _context(context, mesh):
    x = _put(mesh, _x((64, 8)), P(AXIS))
    scale = _put(mesh, 1.0 + 0.1 * _x((8,), 1), P())
    got = with_grads(body(start), loss, (0, 1))(x, scale)       # first call
    want = with_grads(body(_implicit), loss, (0, 1))(x, scale)
  _close("value and grads", got, want, checks)


def _all_to_alls_saveable(context, mesh, checks):
  """jax.checkpoint with all_to_alls_saveable around jax's all_to_all: the
  function's value and grad."""
  def f(v):
    y = jax.lax.all_to_all(jnp.tanh(v @ v.T) @ v, AXIS, 0, 0, tiled=True)
    return jnp.cos(y) ** 2
  def run(fn):
    local = lambda v: (fn(v), jax.grad(lambda v_: jnp.sum(fn(v_)))(v))
    return jax.jit(_shard_map(context, mesh, local, in_specs=P(AXIS),
                              out_specs=(P(AXIS), P(AXIS))))
  with _context(context, mesh):
    x = _put(mesh, _x((64, 8)), P(AXIS))
    got = run(jax.checkpoint(f, policy=jo.all_to_alls_saveable))(x)  # first call
    want = run(f)(x)
  _close("value and grad", got, want, checks)


def _implicit(s):
  return s    # jax casts it where it meets a varying value


def _fsdp_inputs():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 8)).astype(np.float32)
  params = {"w1": (rng.normal(size=(3, 8, 16)) * 0.3).astype(np.float32),
            "w2": (rng.normal(size=(3, 16, 8)) * 0.3).astype(np.float32)}
  return x, params


def _fsdp_layer(h, w):
  return h + jnp.tanh(h @ w["w1"]) @ w["w2"]


def _fsdp_reference(x, params):
  y, _ = lax.scan(lambda h, w: (_fsdp_layer(h, w), None), x, params)
  return jnp.sum(y ** 2)


def _fsdp_shard_map(context, mesh, checks):
  x, params = _fsdp_inputs()
  specs = {"w1": P(None, AXIS), "w2": P(None, AXIS)}

  def local(x, params):
    y = jo.fsdp_scan(_fsdp_layer, x, params, axis=AXIS)
    return lax.psum(jnp.sum(y ** 2), AXIS)
  loss = _shard_map(context, mesh, local, in_specs=(P(AXIS), specs),
                    out_specs=P())
  with _context(context, mesh):
    xs = _put(mesh, x, P(AXIS))
    ps = {k: _put(mesh, v, specs[k]) for k, v in params.items()}
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ps)  # first call
  want = jax.jit(jax.value_and_grad(_fsdp_reference, argnums=(0, 1)))(x, params)
  _close("loss and grads", got, want, checks, rtol=1e-4)


def _fsdp_explicit(context, mesh, checks):
  x, params = _fsdp_inputs()
  loss = lambda x, params: jnp.sum(
      jo.fsdp_scan(_fsdp_layer, x, params, axis=AXIS) ** 2)
  with _context(context, mesh):
    xs = _put(mesh, x, P(AXIS))
    ps = {k: _put(mesh, v, P(None, AXIS)) for k, v in params.items()}
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(xs, ps)  # first call
  want = jax.jit(jax.value_and_grad(_fsdp_reference, argnums=(0, 1)))(x, params)
  _close("loss and grads", got, want, checks, rtol=1e-4)


def _collective_matmul(name):
  def run(context, mesh, checks):
    if name == "all_gather_matmul":
      ours = lambda x, w: jo.all_gather_matmul(x, w, AXIS)
      plain = lambda x, w: lax.all_gather(x, AXIS, tiled=True) @ w
      out_spec = P()
    else:
      ours = lambda x, w: jo.matmul_reduce_scatter(x, w, AXIS)
      plain = lambda x, w: lax.psum_scatter(x @ w, AXIS, tiled=True)
      out_spec = P(AXIS)
    x, w = _x((64, 8), 1), _x((8, 16), 2)
    if name == "matmul_reduce_scatter":       # contract over the sharded dim
      x, w = _x((16, 64), 1), _x((64, 16), 2)
    in_specs = (P(AXIS), P()) if name == "all_gather_matmul" else (P(None, AXIS), P(AXIS))
    with _context(context, mesh):
      args = [_put(mesh, a, s) for a, s in zip((x, w), in_specs)]
      fns = [_shard_map(context, mesh, g, in_specs=in_specs, out_specs=out_spec,
                        check_vma=False) for g in (ours, plain)]
      loss = lambda out: jnp.sum(jnp.sin(out))
      results = [with_grads(f, loss, (0, 1))(*args)
                 for f in fns]                          # ours first
    _close("value and grads", results[0], results[1], checks, rtol=1e-4)
  return run


def _matmul_psum(context, mesh, checks):
  # Megatron's row-parallel matmul: the contracted dimension over the axis,
  # its sum added to a residual that varies over it (to="varying").
  x, w, r = _x((16, 64), 1), _x((64, 8), 2), _x((8 * 16, 8), 3)
  in_specs = (P(None, AXIS), P(AXIS), P(AXIS))

  def body(sum_of):
    return lambda x, w, r: jax.lax.pmean(jnp.sum(jnp.sin(r + sum_of(x, w))), AXIS)
  ours = body(lambda x, w: jo.matmul_psum(x, w, AXIS, to="varying"))
  plain = body(lambda x, w: jax.lax.pcast(lax.psum(x @ w, AXIS), AXIS, to="varying"))
  with _context(context, mesh):
    args = [_put(mesh, a, s) for a, s in zip((x, w, r), in_specs)]
    fns = [_shard_map(context, mesh, g, in_specs=in_specs, out_specs=P())
           for g in (ours, plain)]
    results = [jax.jit(jax.value_and_grad(f, (0, 1, 2)))(*args)
               for f in fns]                          # ours first
  _close("value and grads", results[0], results[1], checks, rtol=1e-4)


def _moe(ours_of):
  """A case of one expert a device, 4 tokens each, k = 2, whose first call
  is `ours_of(expert)`'s; the reference is every (token, choice) through
  its expert gathered by hand."""
  def run(context, mesh, checks):
    n = mesh.shape[AXIS]
    x, w = _x((4 * n, 8), 1), np.abs(_x((4 * n, 2), 2))
    ids = np.random.default_rng(3).integers(0, n, (4 * n, 2)).astype(np.int32)
    experts = _x((n, 8, 8), 4)
    expert = lambda e, t: jnp.tanh(t @ e)
    plain = lambda x, ids, w, e: jnp.einsum(
        "tk,tkd->td", w, jnp.tanh(jnp.einsum("td,tkde->tke", x, e[ids])))
    with _context(context, mesh):
      args = [_put(mesh, a, P(AXIS)) for a in (x, ids, w, experts)]
      f = _shard_map(context, mesh, ours_of(expert), in_specs=(P(AXIS),) * 4,
                     out_specs=P(AXIS), check_vma=False)
      loss = lambda out: jnp.sum(jnp.sin(out))
      got = with_grads(f, loss, (0, 2, 3))(*args)                # first call
    want = with_grads(plain, loss, (0, 2, 3))(x, ids, w, experts)
    _close("value and grads", got, want, checks, rtol=1e-4)
  return run


def _expert_parallel(expert):
  """Dropless."""
  return lambda x, ids, w, e: jo.expert_parallel(expert, x, ids, w, e, axis=AXIS)


def _expert_stream(expert):
  """A stream of 2 token groups (capacity 4: none drops), one ordered block."""
  @jo.program_order(enforce=True)
  def ours(x, ids, w, e):
    stream = jo.expert_stream(expert, e, axis=AXIS, capacity=4)
    stream.send(x[:2], ids[:2], w[:2])
    stream.send(x[2:], ids[2:], w[2:])
    return jnp.concatenate([out.done()[0] for out in stream.close()])
  return ours


def _report_case(first_call):
  """A case whose first call is `first_call(step, args)`: the written
  report of an ordered step, then its compiled one."""
  def run(context, mesh, checks):
    def local(w, x):
      @jo.program_order(enforce=True)    # decorated while the report traces
      def ordered(w, x):
        fut = jo.all_gather_start(w, AXIS, tiled=True)
        y = x @ x.T                      # written while the gather runs
        return (y @ (x @ fut.done()))[:1]
      return ordered(w, x)
    step = _shard_map(context, mesh, local, in_specs=(P(AXIS), P()),
                      out_specs=P(AXIS))
    w, x = _x((64, 8)), _x((8, 64), 3)
    with _context(context, mesh):
      args = _put(mesh, w, P(AXIS)), _put(mesh, x, P())
      written = first_call(step, args, checks)                  # first call
      compiled = jo.overlap_report(step, schedule="compiled")(*args)
      value = jax.jit(step)(*args)
    assert written.schedule == "written", written.schedule
    assert [c.kind for c in written.collectives] == ["all-gather"], written
    assert [c.kind for c in compiled.collectives] == ["all-gather"], compiled
    assert written.written[0].overlapped, written.written
    checks.append("report")
    row = (x @ x.T @ x @ w)[:1]
    _close("value", value, np.concatenate([row] * 8), checks, rtol=1e-4)
  return run


def _deprecated_inspect(step, args, checks):
  # The alias kept one release: the same report, and a DeprecationWarning.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = jo.inspect(step, *args)
  ours = [str(w.message) for w in caught if w.category is DeprecationWarning
          and "jax_overlap.inspect(" in str(w.message)]
  assert len(ours) == 1, [str(w.message) for w in caught]
  assert "overlap_report(fn, hardware=..., schedule=...)(*args)" in ours[0]
  assert report.to_dict() == jo.overlap_report(step)(*args).to_dict()
  checks.append("deprecated alias warns, same report")
  return report


def _measure(context, mesh, checks):
  # jax's profiler around the jitted step, as this process's first call.
  step = _shard_map(context, mesh,
                    lambda w, x: x @ lax.all_gather(w, AXIS, tiled=True),
                    in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
  w, x = _x((64, 8)), _x((16, 64), 5)
  with _context(context, mesh):
    args = _put(mesh, w, P(AXIS)), _put(mesh, x, P(AXIS))
    report = jo.measure(step, steps=2, warmup=1)(*args)         # first call
    value = jax.jit(step)(*args)
  found = [r for r in report.to_dict()["measured"] if r["kind"] == "all-gather"]
  assert sorted(r["device"] for r in found) == list(range(8)), found
  assert all(r["runs"] == 2 for r in found), found
  checks.append("measured")
  _close("value", value, x @ w, checks, rtol=1e-4)


def _cli(context, mesh, checks):
  # The HLO of a plain-jax program (no jax_overlap call), then the CLI's
  # `inspect` on it as this process's first jax_overlap call.
  f = jax.shard_map(lambda v: lax.all_gather(v, AXIS, tiled=True) * 2.0,
                    mesh=mesh, in_specs=P(AXIS), out_specs=P(),
                    check_vma=False)
  x = _put(mesh, _x((64, 8)), P(AXIS))
  path = pathlib.Path(os.environ["FRESH_OUT_DIR"]) / "all_gather.hlo.txt"
  path.write_text(jax.jit(f).lower(x).compile().as_text())
  import io  # noqa: PLC0415
  from jax_overlap._src.cli.main import main  # noqa: PLC0415
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = main(["inspect", str(path), "--json"])               # first call
  assert code == 0, code
  kinds = [c["kind"] for c in json.loads(out.getvalue())["collectives"]]
  assert kinds == ["all-gather"], kinds
  checks.append("cli report")


def _pipeline_loss(context, mesh, checks):
  # 8 stages (one a device), 8 microbatches; the reference runs the stages
  # one after another.
  w = np.stack([np.eye(8, dtype=np.float32) * 0.5 + _x((8, 8), i) * 0.1
                for i in range(8)])
  xs, ys = _x((8, 2, 8), 20), _x((8, 2, 8), 21)
  stage = lambda w, x: jnp.tanh(x @ w)
  loss_of = lambda y, t: jnp.mean((y - t) ** 2)

  def local(w, xs, ys):
    return jo.pipeline_loss(stage, loss_of, w, xs, ys, axis=AXIS)  # first call

  def plain(w, xs, ys):
    def one(x, t):
      for i in range(8):
        x = stage(w[i], x)
      return loss_of(x, t)
    return jnp.mean(jax.vmap(one)(xs, ys))
  with _context(context, mesh):
    args = [_put(mesh, a, s) for a, s in
            zip((jo.pipeline_stage_layout(w, 8), xs, ys), (P(AXIS), P(), P()))]
    ours = _shard_map(context, mesh, local, in_specs=(P(AXIS), P(), P()),
                      out_specs=P())
    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(*args)
  want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(w, xs, ys)
  _close("loss and grads", got, want, checks, rtol=1e-4)


def _pipeline_schedule(context, mesh, checks):
  del mesh
  with _context(context, _mesh(context)):
    plan = jo.pipeline_schedule("1f1b", 4, 8)                     # first call
  # 1F1B's bubble on unit costs: (p - 1) / (m + p - 1).
  assert abs(plan.simulate().bubble_fraction - 3 / 11) < 1e-9, plan
  checks.append("1f1b bubble")


def _fsdp_plan(context, mesh, checks):
  del mesh
  with _context(context, _mesh(context)):
    plan = jo.fsdp_plan(4, prefetch=2, reshard_after_forward=2)   # first call
  # Each layer gathered once in the forward pass; the last two kept.
  assert sorted(g for s in plan.forward for g in s.gathers) == [0, 1, 2, 3], plan
  assert [s.layer for s in plan.forward if s.keeps] == [2, 3], plan
  checks.append("gathers and kept layers")


def _dense_attention(q, k, v, causal):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
  if causal:
    n = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _attention(name):
  def run(context, mesh, checks):
    q, k, v = (_x((1, 32, 8, 4), 30 + i) for i in range(3))
    spec = P(None, AXIS)
    if name == "ring_attention":
      # Laid out and back as arrays sharded over the mesh (Explicit axes in
      # "none" and "explicit"). A ring of 4 (its gradient's compile is this
      # module's largest cost, ~25 s of CPU a context over 8 devices).
      mesh = _mesh(context, 4)
      order = lambda a: jo.to_layout(a, "zigzag", 4)               # first call
      back = lambda a: jo.from_layout(a, "zigzag", 4)
      attend = lambda q, k, v: jo.ring_attention(q, k, v, axis=AXIS, causal=True,
                                                 layout="zigzag")
    else:
      order = back = lambda a: a
      attend = lambda q, k, v: jo.ulysses_attention(q, k, v, axis=AXIS,
                                                    causal=True)  # first call
    with _context(context, mesh):
      args = [order(_put(mesh, a, spec)) for a in (q, k, v)]
      f = _shard_map(context, mesh, attend, in_specs=(spec,) * 3, out_specs=spec)
      loss = lambda out: jnp.sum(jnp.sin(out))
      out, grads = with_grads(f, loss, (0, 1, 2))(*args)
      out, grads = back(out), [back(g) for g in grads]
    dense = lambda *a: _dense_attention(*a, True)
    want = with_grads(dense, loss, (0, 1, 2))(q, k, v)
    _close("output and grads", (out, grads), want, checks, rtol=1e-4)
  return run


#: ENTRY -> (run, the contexts it applies in).
ENTRIES = {
    "program_order_enforce": (_program_order(True), CONTEXTS),
    "program_order_free": (_program_order(False), CONTEXTS),
    **{name: (_future(name), CONTEXTS) for name in _FUTURES},
    "pvary_start": (_pvary, CONTEXTS),
    "all_to_alls_saveable": (_all_to_alls_saveable, CONTEXTS),
    "fsdp_scan_shard_map": (_fsdp_shard_map, CONTEXTS),
    "fsdp_scan_explicit": (_fsdp_explicit, ("explicit",)),
    "fsdp_plan": (_fsdp_plan, CONTEXTS),
    "all_gather_matmul": (_collective_matmul("all_gather_matmul"), CONTEXTS),
    "matmul_reduce_scatter": (_collective_matmul("matmul_reduce_scatter"),
                              CONTEXTS),
    "matmul_psum": (_matmul_psum, CONTEXTS),
    "expert_parallel": (_moe(_expert_parallel), CONTEXTS),
    "expert_stream": (_moe(_expert_stream), CONTEXTS),
    "pipeline_loss": (_pipeline_loss, CONTEXTS),
    "pipeline_schedule": (_pipeline_schedule, CONTEXTS),
    "ring_attention": (_attention("ring_attention"), CONTEXTS),
    "ulysses_attention": (_attention("ulysses_attention"), CONTEXTS),
    "overlap_report": (_report_case(
        lambda step, args, checks: jo.overlap_report(step)(*args)), CONTEXTS),
    "inspect": (_report_case(_deprecated_inspect), CONTEXTS),
    "measure": (_measure, CONTEXTS),
    "cli": (_cli, ("none",)),
}


def all_cases() -> list[str]:
  return [f"{e}@{c}" for e, (_, cs) in ENTRIES.items() for c in cs]


# --- running -------------------------------------------------------------------

def _run_case(case: str, out_dir: pathlib.Path) -> None:
  entry, context = case.split("@")
  result = {"ok": False, "error": "", "checks": [], "seconds": 0.0}
  began = time.monotonic()
  try:
    run, contexts = ENTRIES[entry]
    assert context in contexts, f"{entry} does not apply in {context}"
    run(context, _mesh(context), result["checks"])
    result["ok"] = True
  except BaseException:  # noqa: BLE001 - reported to the test
    result["error"] = traceback.format_exc()
  result["seconds"] = round(time.monotonic() - began, 2)
  (out_dir / f"{case}.json").write_text(json.dumps(result))


def _nothing_started() -> None:
  from jax._src import xla_bridge  # noqa: PLC0415
  backends = getattr(xla_bridge, "_backends", {})
  assert not backends, f"a backend started before the cases: {list(backends)}"


def _cpu_seconds(pid: int) -> float:
  """The user + system CPU seconds process `pid` has used (all its threads;
  0 where /proc cannot tell)."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return 0.0
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fork_all(cases: list[str], out_dir: pathlib.Path) -> None:
  pending, running = list(cases), {}
  while pending or running:
    while pending and len(running) < AT_ONCE:
      case = pending.pop(0)
      pid = os.fork()
      if pid == 0:  # the child: a process whose first jax_overlap call is next
        try:
          _run_case(case, out_dir)
        finally:
          os._exit(0)
      running[pid] = (case, time.monotonic())
    time.sleep(0.02)
    for pid, (case, started) in list(running.items()):
      done, status = os.waitpid(pid, os.WNOHANG)
      cpu, wall = _cpu_seconds(pid), time.monotonic() - started
      if done == 0 and cpu < CASE_CPU_S and wall < CASE_WALL_S:
        continue
      if done == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        error = (f"hung: killed after {cpu:.0f} CPU seconds, {wall:.0f} s "
                 f"(limits {CASE_CPU_S} and {CASE_WALL_S})")
      else:
        error = f"the process ended with status {status}"
      del running[pid]
      path = out_dir / f"{case}.json"
      if not path.exists() or done == 0:
        path.write_text(json.dumps({"ok": False, "error": error, "checks": []}))


def main(argv: list[str]) -> None:
  jax.config.update("jax_num_cpu_devices", 8)
  out_dir, rest = pathlib.Path(argv[0]), argv[1:]
  os.environ["FRESH_OUT_DIR"] = str(out_dir)
  no_fork = rest[:1] == ["--no-fork"]
  cases = rest[1:] if no_fork else rest
  _nothing_started()
  if no_fork:
    assert len(cases) == 1, "--no-fork runs one case"
    _run_case(cases[0], out_dir)
  else:
    _fork_all(cases, out_dir)


if __name__ == "__main__":
  main(sys.argv[1:])
