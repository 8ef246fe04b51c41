"""The real TPU and GPU compilers, ahead of time: what the library's programs
compile to there (nothing runs; the compile and its schedule are checked).

Targets: TPU v5e 2x4 and v5p 2x2x2 (libtpu), GPU H100 and A100 (the CUDA
plugin, XLA's target configs in specs/), 8 devices each, and H100 on 2 hosts
x 8 (topology "1x2x8", 16 devices); `make test-aot` installs the compilers in
.venv-aot, and without them every test here skips. Each compile costs about a
second: shapes are tiny and each program compiles once (`_compiled` caches by
name).

Older jax (`make test-aot-jax0.11.0`, `make test-aot-jax0.10.2`) runs
OLDER_JAX_SUBSET on OLDER_JAX_TARGETS (its `newest_jax` marker; the rest skip):
the written order, the five futures and fsdp_scan in both contexts, on TPU
v5e and GPU H100. There a future's start is the plain collective (or on TPU
its form's all-to-all), left out of program_order's barriers until its done,
and XLA makes it async itself (quirks "gpu-plain-future" / "tpu-plain-future");
the tests assert the same windows as on jax 0.12, and OLDER_IN_FLIGHT and
EMPTY_WINDOW_OLDER state, measured, where fewer are in flight. A module that
the plugin refuses with OLDER_JAX_PLUGIN_GAP's error xfails.

Each expectation that states today's shortfall (SYNC_ON, NOT_WARNED_YET,
SHORT_TODAY, PERMUTES_SHORT) is a table entry: when the library or a
compiler changes, the test that fails names the entry to drop.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings

import compilers  # first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import pytest

import schedule
from compilers import Mesh, NamedSharding, P, arg, compiled_text, target

import jax_overlap
from jax_overlap import program_order
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async

from jax_overlap._src.xla import compiled_order

#: jax < 0.12: a future is its plain collective on TPU/GPU.
OLDER = not _compat.ASYNC_CUSTOM_CALLS
needs_pairs = pytest.mark.skipif(
    OLDER, reason="jax < 0.12: a future is its plain collective, which XLA "
    "makes async itself; the older lanes run OLDER_JAX_SUBSET")

#: What `make test-aot-jaxX` (jax < 0.12) runs: these tests, on these targets
#: (the `newest_jax` marker's older-jax subset; tests/aot/conftest.py).
OLDER_JAX_SUBSET = (
    "test_compiled_schedule_keeps_written_order",
    "test_future_is_an_async_pair_around_the_matmul",
    "test_fsdp_scan_forward_gathers_the_next_layer_behind_this_one",
    "test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters",
    "test_fsdp_scan_on_an_explicit_mesh",
    "test_a_small_gather_over_two_axes_is_async_or_said",
    "test_collective_matmul_sends_behind_block_matmuls",
)
OLDER_JAX_TARGETS = ("tpu_v5e", "gpu_h100")
#: and A100's cells that hang on the latency-hiding scheduler: its spec has it
#: off, and the library turns it on for plain-future modules with a loop or a
#: psum_start, not for all_gather_matmul's straight-line permutes
#: (xla/compile_options.py).
OLDER_JAX_EXTRA = (
    "test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters[gpu_a100]",
    "test_future_is_an_async_pair_around_the_matmul[psum-gpu_a100]",
    "test_collective_matmul_sends_behind_block_matmuls[forward-all_gather_matmul-gpu_a100]")
pytestmark = pytest.mark.newest_jax(older_jax=[
    f"{test}[*{target}]" for test in OLDER_JAX_SUBSET
    for target in OLDER_JAX_TARGETS] + list(OLDER_JAX_EXTRA))

#: jax 0.10.2 / 0.11.0 with their plugins (libtpu 0.0.42.1 / 0.0.44.1,
#: jax-cuda12-plugin of the same version): the StableHLO async_start/async_done
#: region (xla/futures.py `_to_async_region_pair`, CPU only now) is
#: refused by the PJRT plugins' StableHLO (1.13.7 / 1.14.0): "Failed to
#: serialize StableHLO to plugin version ...: failed to legalize operation
#: 'vhlo.async_start_v1'". Should a module still hold one, its test xfails.
OLDER_JAX_PLUGIN_GAP = (
    f"jax {jax.__version__}: a future's async region cannot be serialized for "
    "the TPU/GPU plugin ('vhlo.async_start_v1' is illegal there); open (issue 16)")

N = 8                      # devices on the 8-device targets


def ring(n):
  return [(i, (i + 1) % n) for i in range(n)]
FUTURES = ("all_gather", "psum", "psum_scatter", "all_to_all", "ppermute",
           "ragged_all_to_all")


def _smap(t, f, in_specs, out_specs=P("x")):
  return jax.shard_map(f, mesh=t.mesh, in_specs=in_specs, out_specs=out_specs)


@functools.cache
def _compiled(name: str, case: str, *extra) -> tuple[str, tuple[str, ...]]:
  """(scheduled text, warning messages) of program `case` for target `name`.

  A program is `(fn, args)`, or `(fn, args, context)` when it must be
  lowered inside a context (an explicit mesh's `jax.set_mesh`)."""
  t = target(name, explicit=case in EXPLICIT_PROGRAMS)
  fn, args, *context = PROGRAMS[case](t, *extra)
  # The library says each of these once per process; each compile here says
  # its own (else what a test sees depends on the tests before it).
  not_async._warned.clear()
  compiled_order._warned.clear()
  with warnings.catch_warnings(record=True) as caught, \
      (context[0] if context else contextlib.nullcontext()):
    warnings.simplefilter("always")
    text = compiled_text(fn, *args)
  return text, tuple(str(w.message) for w in caught
                     if issubclass(w.category, _SAID))


#: What the library says at compile time about overlap it cannot give.
_SAID = (jax_overlap.CollectiveNotAsyncWarning, jax_overlap.OrderNotKeptWarning)


# --- programs ------------------------------------------------------------------

def _start(kind, x, n):
  if kind == "all_gather":
    return jax_overlap.all_gather_start(x, "x", tiled=True)
  if kind == "psum":
    return jax_overlap.psum_start(x, "x")
  if kind == "psum_scatter":
    return jax_overlap.psum_scatter_start(x, "x", tiled=True)
  if kind == "all_to_all":
    return jax_overlap.all_to_all_start(x, "x", 0, 0, tiled=True)
  if kind == "ragged_all_to_all":
    # An even split: chunk j (rows j*c .. j*c+c) to device j, received into
    # rows (sender)*c.
    c = x.shape[0] // n
    me = jax.lax.axis_index("x")
    sizes = jnp.full((n,), c, jnp.int32)
    offsets = jnp.arange(n, dtype=jnp.int32) * c
    return jax_overlap.ragged_all_to_all_start(
        x, jnp.zeros_like(x), offsets, sizes, jnp.full((n,), me * c, jnp.int32),
        sizes, axis_name="x")
  return jax_overlap.ppermute_start(x, "x", ring(n))


def future_program(t, kind, rank=2):
  """A future under program_order with a matmul written between its halves."""
  @program_order(enforce=True)
  def body(x, w):
    future = _start(kind, x, t.n)
    y = jnp.tanh(w @ w)
    return future.done(), y

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  # 16 rows a device: the scatter and split dimensions divide by 16 devices.
  shape = (16 * t.n, 16) if rank == 2 else (16 * t.n, 4, 16)
  return _smap(t, f, (P("x"), P())), (arg(t, shape, P("x")), arg(t, (16, 16)))


LAYERS, WEIGHTS = 4, 2
# Layer 0's weights gathered in groups by use order inside shard_map
# (patterns/fsdp/use_order.py): `_layer` reads b after its matmul on a, so
# its forward gather is two (its backward's gradients, paced, stay one).
SPLIT = 1
# The counts below are per weight (measured so on libtpu 0.0.52 and H100):
# those programs pass bucket=False; fsdp_scan's default (one bucket a layer)
# has its own test.


def _layer(x, p):
  return jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"])


def fsdp_program(t, grad, bucket=False, reshard=True, prefetch=1,
                 has_ys=False):
  """`has_ys`: each layer also returns an aux loss, stacked as lax.scan's ys
  (fsdp_scan(has_ys=True)), summed into the loss."""
  def aux_layer(x, w):
    y = _layer(x, w)
    return y, jnp.mean(y ** 2)

  def loss(x, ps):
    out = jax_overlap.fsdp_scan(aux_layer if has_ys else _layer, x, ps,
                                axis="x", bucket=bucket,
                                reshard_after_forward=reshard,
                                prefetch=prefetch, has_ys=has_ys)
    if has_ys:
      return (out[0].sum() + out[1].sum())[None]
    return out.sum()[None]
  spec = {"a": P(None, "x"), "b": P(None, "x")}
  f = fwd = _smap(t, loss, (P("x"), spec))
  if grad:
    f = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
  w = arg(t, (LAYERS, 16, 16), P(None, "x"))
  return f, (arg(t, (64, 16), P("x")), {"a": w, "b": w})


def fsdp_ends_program(t, ends, reshard=None):
  """fsdp_program's stack (one bucket a layer) with an input projection
  before it and a head after it, value_and_grad of all three: in
  fsdp_scan(before=, after=) (`ends`), or written around the call;
  `reshard`: reshard_after_forward (None: fsdp_scan's default)."""
  kw = {} if reshard is None else dict(reshard_after_forward=reshard)

  def loss(x, ps, emb, head):
    if ends:
      return jax_overlap.fsdp_scan(
          _layer, x, ps, axis="x", before=lambda x: jnp.tanh(x @ emb),
          after=lambda h: jnp.tanh(h @ head).sum(), **kw)[None]
    h = jax_overlap.fsdp_scan(_layer, jnp.tanh(x @ emb), ps, axis="x", **kw)
    return jnp.tanh(h @ head).sum()[None]
  spec = {"a": P(None, "x"), "b": P(None, "x")}
  fwd = _smap(t, loss, (P("x"), spec, P(), P()))
  f = jax.value_and_grad(lambda *a: fwd(*a).sum(), argnums=(1, 2, 3))
  w = arg(t, (LAYERS, 16, 16), P(None, "x"))
  return f, (arg(t, (64, 16), P("x")), {"a": w, "b": w}, arg(t, (16, 16)),
             arg(t, (16, 16)))


def collective_matmul_program(t, which, grad):
  if which == "all_gather_matmul":
    body = lambda x, w: jax_overlap.all_gather_matmul(x, w, "x")
  else:
    body = lambda x, w: jax_overlap.matmul_reduce_scatter(x, w, "x")
  f = fwd = _smap(t, body, (P("x"), P()))
  if grad:
    f = jax.grad(lambda x, w: fwd(x, w).sum(), argnums=(0, 1))
  shape = (64, 16) if which == "all_gather_matmul" else (512, 16)
  return f, (arg(t, shape, P("x")), arg(t, (16, 16)))


def fsdp_explicit_program(t, grad):
  """fsdp_scan on an Explicit mesh (no shard_map), as tests/patterns/fsdp/fsdp_test.py's
  explicit context: the weights sharded over "x", lowered in `jax.set_mesh`."""
  def loss(x, ps):
    return jax_overlap.fsdp_scan(_layer, x, ps, axis="x").sum()
  f = jax.value_and_grad(loss, argnums=1) if grad else loss
  w = arg(t, (LAYERS, 16, 16), P(None, "x"))
  return f, (arg(t, (64, 16), P("x")), {"a": w, "b": w}), _use_mesh(t.mesh)


def dp_tp_program(t, overlapped):
  """A data + tensor parallel block, one training step: a Megatron-style MLP
  with sequence parallelism on a 2-D mesh ('data', 'model') = (2, n / 2):
  the column-parallel matmul after an all-gather of the sequence over
  'model', the row-parallel matmul then a reduce-scatter over 'model'
  (plain jax collectives, or the library's all_gather_matmul /
  matmul_reduce_scatter if `overlapped`), and value_and_grad of the weights
  (their gradients are summed over 'data')."""
  import numpy as np  # noqa: PLC0415
  mesh = Mesh(np.array(t.mesh.devices).reshape(2, t.n // 2), ("data", "model"))

  def block(x, w1, w2):  # x: (batch, sequence, width) blocks
    if overlapped:
      h = jnp.tanh(jax_overlap.all_gather_matmul(x, w1, "model", gather_dimension=1))
      return jax_overlap.matmul_reduce_scatter(h, w2, "model", scatter_dimension=1)
    h = jnp.tanh(jax.lax.all_gather(x, "model", axis=1, tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "model", scatter_dimension=1, tiled=True)

  specs = (P("data", "model", None), P(None, "model"), P("model", None))
  mlp = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=specs[0])
  f = jax.value_and_grad(lambda x, w1, w2: jnp.sum(mlp(x, w1, w2) ** 2),
                         argnums=(1, 2))
  shapes = ((16, 16, 16), (16, 32), (32, 16))
  return f, tuple(jax.ShapeDtypeStruct(shape, jnp.float32,
                                       sharding=NamedSharding(mesh, spec))
                  for shape, spec in zip(shapes, specs))


def two_axes_gather_program(t, rows):
  """future_program's all_gather_start over both axes of a (2, n / 2) mesh
  (no permute form: that takes one axis), `rows` x 16 f32 a device."""
  import numpy as np  # noqa: PLC0415
  mesh = Mesh(np.array(t.mesh.devices).reshape(2, t.n // 2), ("a", "b"))

  @program_order(enforce=True)
  def body(x, w):
    future = jax_overlap.all_gather_start(x, ("a", "b"), tiled=True)
    y = jnp.tanh(w @ w)
    return future.done(), y

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  spec = P(("a", "b"))
  fn = jax.shard_map(f, mesh=mesh, in_specs=(spec, P()), out_specs=spec)
  return fn, (jax.ShapeDtypeStruct((rows * t.n, 16), jnp.float32,
                                   sharding=NamedSharding(mesh, spec)),
              jax.ShapeDtypeStruct((128, 128), jnp.float32,
                                   sharding=NamedSharding(mesh, P())))


def plain_gather_program(t, ordered):
  """A plain `jax.lax.all_gather` with a matmul written after it, in an
  ordered block (`ordered`: True), in a free block inside one (`"free"`, the
  README's quick start) or left to XLA (False)."""
  def body(x, w):
    return jax.lax.all_gather(x, "x", tiled=True), jnp.tanh(w @ w)
  if ordered == "free":
    free = program_order(enforce=False)(body)
    body = program_order(enforce=True)(lambda x, w: free(jnp.tanh(x), w))
  elif ordered:
    body = program_order(enforce=True)(body)

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  return _smap(t, f, (P("x"), P())), (arg(t, (16 * t.n, 16), P("x")),
                                      arg(t, (128, 128)))


def _use_mesh(mesh):
  return (jax.set_mesh(mesh) if hasattr(jax, "set_mesh")
          else jax.sharding.use_mesh(mesh))


def _compile(name, case, *extra):
  """`_compiled`, with jax < 0.12's known plugin gap turned into an xfail."""
  try:
    return _compiled(name, case, *extra)
  except Exception as e:  # noqa: BLE001 - only the known gap is let through
    if OLDER and "vhlo.async_start_v1" in str(e):
      pytest.xfail(OLDER_JAX_PLUGIN_GAP)
    raise


PROGRAMS = {"future": future_program, "fsdp": fsdp_program,
            "fsdp_explicit": fsdp_explicit_program, "dp_tp": dp_tp_program,
            "collective_matmul": collective_matmul_program,
            "fsdp_ends": fsdp_ends_program, "two_axes_gather": two_axes_gather_program,
            "plain_gather": plain_gather_program}
EXPLICIT_PROGRAMS = {"fsdp_explicit"}


def _async(text, kind):
  return [w for w in schedule.windows(text) if w.kind == kind]


# --- the written order ------------------------------------------------------------

def written_order_kept(name, variants=(False, True)):
  """tests/ordering/schedule_test.py's bodies compiled for `name`: {(case, ordered):
  (whether the scheduled order is the written one, the scheduled markers)},
  for the undecorated (False) and program_order (True) `variants`."""
  import lowered
  import schedule_test as st
  t = target(name)
  xyz = (arg(t, (64, 64)), arg(t, (64,)), arg(t, (64,)))
  kept = {}
  for case, make in sorted(st.CASES.items()):
    for po in [(st.unordered, program_order)[v] for v in variants]:
      jitted = jax.jit(make(po))
      order = schedule.scheduled_markers(jitted.lower(*xyz).compile().as_text(),
                                         st.MARKERS)
      closed = jitted.trace(*xyz).jaxpr
      live, _ = _compat.dce(closed, [True] * len(_compat.open_jaxpr(closed).outvars))
      kept[case, po is program_order] = (
          lowered.follows(order, lowered.written_markers(live)), order)
  return kept


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_h100_2x8"])
def test_compiled_schedule_keeps_written_order(name):
  import schedule_test as st
  # 16 GPUs: the ordered bodies only (the same compiler as 1x1x8, where the
  # undecorated ones are checked; each GPU compile of the four costs ~6 s).
  kept = written_order_kept(name, (True,) if name == "gpu_h100_2x8" else (False, True))
  # XLA's own order differs from the written one (so this can fail) ...
  assert not any(kept.get((c, False), (False,))[0] for c in st.CASES), kept
  # ... and program_order's compiled order is the written one.
  assert all(kept[c, True][0] and len(kept[c, True][1]) >= 3 for c in st.CASES), kept


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
@pytest.mark.subprocess
def test_an_ordered_block_with_calls_of_literals_compiles(name):
  """An ordered block holding jit calls of literals alone (`jnp.arange(8) %
  3`: jnp's remainder is a jit; `pipeline_loss` under a `jax.checkpoint`
  policy with `fsdp_scan` stages has such calls) compiles on both
  compilers, differentiated. Fenced in a late-inlined call, their constants
  were cloned with its control edges and XLA's CSE aborted the process on
  both; they are bound unfenced (ordering/barriers.py `_calls`). Run apart:
  an abort fails only this test."""
  target(name)
  out = compilers.compile_in_subprocess(f"""
      import jax, jax.numpy as jnp
      import jax_overlap
      t = target({name!r})

      @jax_overlap.program_order(enforce=True)
      def block(x):
        y = jnp.tanh(x) * jax.jit(lambda: jnp.arange(8) % 3)().astype(x.dtype)
        return y + jax.jit(lambda: jnp.arange(8) % 3 + 1)().astype(x.dtype)

      f = jax.shard_map(jax.grad(lambda x: jnp.sum(block(x) ** 2)),
                        mesh=t.mesh, in_specs=P("x"), out_specs=P("x"))
      compiled_text(f, arg(t, (t.mesh.devices.size, 8), P("x")))
      print("compiled")
      """)
  assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-2000:]


# --- the six futures ----------------------------------------------------------

#: (target, future) pairs the compiler cannot take as an async pair: the
#: library lowers them synchronously and says so once. (None left with
#: jax 0.12: on TPU psum, psum_scatter and all_to_all, and all_gather on
#: v5p, are async as their TPU form, an all-to-all; tests/aot/tpu_forms_compiled_test.py.)
#: ragged_all_to_all_start everywhere: XLA's async custom calls have no
#: ragged all-to-all ("No registered implementation for custom call to
#: ragged-all-to-all-start for platform CUDA"; TPU: "Custom emitter for
#: ragged-all-to-all-start not found"), so its real op runs whole at the
#: start, and the fences keep it synchronous.
SYNC_ON: set = {(name, "ragged_all_to_all") for name in compilers.TARGETS}
#: Of SYNC_ON, those compiled synchronous with nothing said.
NOT_WARNED_YET: dict = {}
_TPU_FORM_KIND = {"psum": "all-to-all", "psum_scatter": "all-to-all",
                  "all_to_all": "all-to-all"}
#: On v5p all_gather_start and psum_scatter_start are N-1 collective-permutes
#: in flight at once (collectives/permute_forms.py), and so are both halves
#: of psum_start's ring (collectives/ring_psum.py).
_V5P_FORM_KIND = dict(_TPU_FORM_KIND, all_gather="collective-permute",
                      psum_scatter="collective-permute", psum="collective-permute")
_PERMUTE_FORMS = ("all_gather", "psum_scatter")


def _permute_form(name, kind) -> bool:
  """Whether future `kind` is N-1 permutes on `name` (`permute_gathers`)."""
  return kind in _PERMUTE_FORMS and (
      name == "tpu_v5p" or (kind == "all_gather" and permute_gathers(name)))
_HLO_KIND = {"all_gather": "all-gather", "psum": "all-reduce",
             "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all",
             "ppermute": "collective-permute",
             "ragged_all_to_all": "ragged-all-to-all"}


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_a100",
                                  "gpu_h100_2x8"])
@pytest.mark.parametrize("kind", FUTURES)
def test_future_is_an_async_pair_around_the_matmul(name, kind):
  text, warned = _compile(name, "future", kind)
  hlo_kind = _HLO_KIND[kind]
  if name.startswith("tpu"):
    forms = _V5P_FORM_KIND if name == "tpu_v5p" else _TPU_FORM_KIND
    hlo_kind = forms.get(kind, hlo_kind)
  pairs = _async(text, hlo_kind)
  # (jax < 0.12: the start is the plain collective, or on TPU its form's
  # all-to-all, left out of the barriers until the done, and XLA makes it
  # async by itself: quirks "gpu-plain-future" / "tpu-plain-future".)
  if (name, kind) in SYNC_ON:
    # (jax < 0.12 on H100: XLA makes the ragged all-to-all async itself,
    # with nothing in its window.)
    assert not (OLDER and any(w.matmuls for w in pairs) or pairs and not OLDER), pairs
    if not warned and (name, kind) in NOT_WARNED_YET:
      pytest.xfail(NOT_WARNED_YET[name, kind])
    platform = "tpu" if name.startswith("tpu") else "cuda"
    assert any(f"{kind}_start on {platform}" in m for m in warned), warned
    return
  if kind == "psum" and permute_gathers(name):
    # psum_start's ring (collectives/ring_psum.py): its reduce-scatter half
    # (v5p: N-1 permutes; v5e: the all-to-all) with the matmul in flight,
    # then its all-gather half as all_gather_start there, N-1 permutes,
    # started after the matmul (its window empty with one matmul written).
    futures = schedule.permute_futures(text)
    gathers = [f for f in futures if f.is_gather]
    scatters = [f for f in futures if not f.is_gather] if name == "tpu_v5p" \
        else pairs
    n = target(name).n
    assert [len(f.parts) for f in gathers] == [n - 1], futures
    assert len(scatters) == 1 and scatters[0].matmuls >= 1, (scatters, futures)
    assert not [m for m in warned if "outside the versions" not in m], warned
    return
  if _permute_form(name, kind):
    # One future of N-1 permutes, every one with the matmul in flight.
    futures = schedule.permute_futures(text)
    assert [len(f.parts) for f in futures] == [target(name).n - 1], futures
    assert futures[0].matmuls >= 1, futures[0]
    assert not warned, warned
    return
  assert len(pairs) == 1, schedule.windows(text)
  if (jax.__version__, name, kind) in EMPTY_WINDOW_OLDER and not pairs[0].matmuls:
    pytest.xfail(EMPTY_WINDOW_OLDER[jax.__version__, name, kind])
  assert pairs[0].matmuls >= 1, pairs[0]
  assert not warned, warned


@pytest.mark.parametrize("name", ["tpu_v5e"])
def test_a_small_gather_over_two_axes_is_async_or_said(name):
  # jax < 0.12: the future is the plain all-gather, which libtpu 0.0.42.1 /
  # 0.0.44.1 turns into a synchronous all-reduce below 512 bytes a shard
  # (measured: 256 bytes sync, 512 async); the library says so once
  # (xla/futures.py). jax 0.12: an async pair at either size.
  for rows, small in ((2, True), (8, False)):
    text, warned = _compile(name, "two_axes_gather", rows)
    gathers = _async(text, "all-gather")
    said = any("synchronous all-reduce" in m for m in warned)
    if OLDER and small:
      assert not gathers and said, (gathers, warned)
    else:
      assert len(gathers) == 1 and gathers[0].matmuls >= 1, schedule.windows(text)
      assert not said, warned


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_a_plain_gather_in_an_ordered_block_is_said(name):
  # Left to XLA, a plain all-gather compiles async; in an ordered block the
  # fences keep it synchronous, and the library says so once, naming the
  # collective and its future (collectives/not_async.py).
  free, free_warned = _compile(name, "plain_gather", False)
  assert _async(free, "all-gather") and not free_warned, (
      schedule.windows(free), free_warned)
  fenced, warned = _compile(name, "plain_gather", True)
  assert not _async(fenced, "all-gather"), schedule.windows(fenced)
  said = [m for m in warned if "inside an ordered block" in m]
  assert len(said) == 1, warned
  assert "jax.lax.all_gather" in said[0], said
  assert "jax_overlap.all_gather_start" in said[0], said


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_a_gather_in_a_free_block_is_left_to_xla(name):
  # The README's quick start: a plain gather in a free block, beside a
  # matmul, inside an ordered block. XLA may overlap the two, so nothing is
  # said (xla/compile_options.py, `_has_company`).
  text, warned = _compile(name, "plain_gather", "free")
  assert not [m for m in warned if "inside an ordered block" in m], warned
  gathers = _async(text, "all-gather")
  assert gathers and gathers[0].matmuls >= 1, schedule.windows(text)


#: (jax, target, future) -> why its pair has nothing in its window there
#: (measured). (Empty: H100's psum_start on jax 0.11.0 had the matmul before
#: its start until such modules got XLA's speed-of-light estimator off, quirk
#: "gpu-plain-future-estimator".)
EMPTY_WINDOW_OLDER: dict = {}


def permute_gathers(name) -> bool:
  """Whether `name`'s all-gather futures are N-1 permutes: v5p (quirk
  "tpu-permute-forms"), and v5e on jax < 0.12 ("tpu-plain-permute-gathers")."""
  return name == "tpu_v5p" or (OLDER and name == "tpu_v5e")


def _gathers(text, name):
  """The windows of the all-gather futures: where they are permutes
  (`permute_gathers`) each is one `schedule.Composed` of permutes, with the
  matmuls all its parts have in flight. Each as many times as it runs
  (`_runs`)."""
  if permute_gathers(name):
    return schedule.runs(text, [f for f in schedule.permute_futures(text)
                                if f.is_gather])
  return _runs(text, "all-gather")


def _scatters(text, name):
  """As `_gathers`, for the reduce-scatter futures (permutes on v5p)."""
  if name == "tpu_v5p":
    return schedule.runs(text, [f for f in schedule.permute_futures(text)
                                if not f.is_gather])
  return _runs(text, "reduce-scatter")


def _runs(text, kind):
  """`_async`, each window as many times as it runs: fsdp_scan's loops
  hold one layer an iteration (its default unroll), so a loop body's
  window is one layer's, run once a layer."""
  return schedule.runs(text, _async(text, kind))


def _again(**kw) -> int:
  """1 where fsdp_scan's plan runs the last layer in the loops
  (`Step.again`): its forward step gathers it once more, its backward step
  reduce-scatters a zero gradient, one window more each."""
  return int(any(s.again for s in jax_overlap.fsdp_plan(LAYERS, **kw).steps))


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100"])
def test_two_ppermute_futures_of_one_value_stay_two(name):
  # x sent both ways round the ring, unfenced: XLA's CSE compares a custom
  # call's operands and backend config, not the frontend attributes where
  # the permutation is, and merged the two starts into one (TPU: 1 start;
  # H100: 1 permute), so both results came from one permutation. Each
  # permute start carries its config as its backend config too.
  if OLDER:
    pytest.skip("jax < 0.12 lowers the plain permutes, which CSE tells apart")
  t = target(name)
  n = t.n

  def f(x):
    a = jax_overlap.ppermute_start(x, "x", [(j, (j + 1) % n) for j in range(n)])
    b = jax_overlap.ppermute_start(x, "x", [(j, (j - 1) % n) for j in range(n)])
    return a.done() - b.done()
  text = compiled_text(_smap(t, f, P("x")), arg(t, (64, 16), P("x")))
  pairs = re.findall(r" collective-permute(?:-start)?\(.*?source_target_pairs=(\{[^=]*\}),",
                     text)
  assert len(set(pairs)) == 2, pairs


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_two_fsdp_scans_over_one_weight_compile(name):
  # A pipeline's forward and backward ticks each run a stage's fsdp_scan
  # over the same weights. Before each start carried its config as its
  # backend config, the H100 compiler's CSE merged the two scans' identical
  # all-gather starts into one and its verifier refused the start left with
  # two dones ("Async start all-gather-start.1 is matched by multiple async
  # done instructions"); the v5e compiled.
  if OLDER:
    pytest.skip("jax < 0.12 lowers the plain gathers, which CSE tells apart")
  t = target(name)
  layer = lambda x, w: jnp.tanh(x @ w)

  def f(w, x, y):
    both = (jax_overlap.fsdp_scan(layer, x, w, axis="x").sum()
            + jax_overlap.fsdp_scan(layer, y, w, axis="x").sum())
    return both[None]
  loss = lambda *a: _smap(t, f, (P(None, "x"), P("x"), P("x")))(*a).sum()
  text = compiled_text(jax.value_and_grad(loss), arg(t, (2, 256, 256), P(None, "x")),
                       arg(t, (64, 256), P("x")), arg(t, (64, 256), P("x")))
  starts = re.findall(r"all-gather-start", text)
  assert starts, "no async all-gather"


#: Futures along a minor axis: (collective, shard shape, keywords). Before
#: collectives/major_dim.py, libtpu 0.0.52 (v5e) aborted the process on the
#: first all-gather ("RET_CHECK IsMajorDimAllGather") and refused the
#: second, and the H100 compiler refused every one of these ("Assigned
#: parameter shape f32[8,16]{0,1} does not match layout of computation
#: shape").
MINOR_AXIS = {
    "all_gather_axis1": ("all_gather", (8, 16), dict(axis=1, tiled=True)),
    "all_gather_axis2_rank3": ("all_gather", (8, 16, 4), dict(axis=2, tiled=True)),
    "all_gather_axis1_stacked": ("all_gather", (8, 16), dict(axis=1)),
    "psum_scatter_dim1": ("psum_scatter", (8, 16),
                          dict(scatter_dimension=1, tiled=True)),
    "all_to_all_split1": ("all_to_all", (8, 16),
                          dict(split_axis=1, concat_axis=0, tiled=True)),
    "all_to_all_split1_concat1": ("all_to_all", (8, 16),
                                  dict(split_axis=1, concat_axis=1, tiled=True)),
}


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100"])
@pytest.mark.parametrize("case", sorted(MINOR_AXIS))
def test_future_along_a_minor_axis_is_an_async_pair(name, case):
  kind, shape, kw = MINOR_AXIS[case]
  t = target(name)

  @program_order(enforce=True)
  def f(x, w):
    future = getattr(jax_overlap, f"{kind}_start")(x, "x", **kw)
    y = jnp.tanh(w @ w)
    return (future.done().sum() + y.sum())[None]
  text = compiled_text(_smap(t, f, (P("x"), P())),
                       arg(t, (shape[0] * t.n,) + shape[1:], P("x")),
                       arg(t, (128, 128)))
  if name == "tpu_v5p" and kind in _PERMUTE_FORMS:
    pairs = _gathers(text, name) + _scatters(text, name)
  else:
    forms = {"tpu_v5e": _TPU_FORM_KIND, "tpu_v5p": _V5P_FORM_KIND}.get(name, {})
    pairs = _async(text, forms.get(kind, _HLO_KIND[kind]))
  assert len(pairs) == 1 and pairs[0].matmuls >= 1, schedule.windows(text)


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_fsdp_scan_with_weights_sharded_on_their_minor_axis(name, grad):
  # Column-sharded weights (P(None, None, "x"), shard_dims 2): each gather
  # is along the weight's minor axis. Before collectives/major_dim.py,
  # libtpu 0.0.52 (v5e) refused the module ("IsMajorDimAllGather") and the
  # H100 compiler too ("Asynchronous computation async_computation expected
  # to contain only the root and parameter instructions"). Now the windows
  # are the default layout's (buckets on; layer 0 split by use order).
  t = target(name)
  spec = {"a": P(None, None, "x"), "b": P(None, None, "x")}

  def loss(x, ps):
    return jax_overlap.fsdp_scan(_layer, x, ps, axis="x",
                                 shard_dims={"a": 2, "b": 2}).sum()[None]
  f = fwd = _smap(t, loss, (P("x"), spec))
  if grad:
    f = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
  w = arg(t, (LAYERS, 16, 16), P(None, None, "x"))
  text = compiled_text(f, arg(t, (64, 16), P("x")), {"a": w, "b": w})
  passes = 2 if grad else 1
  gathers = _gathers(text, name)
  assert sum(g.matmuls >= 1 for g in gathers) >= passes * (LAYERS - 1), gathers
  if grad:
    scatters = (_runs(text, "all-to-all") if name == "tpu_v5e" else
                _scatters(text, name))
    assert sum(s.matmuls >= 1 for s in scatters) >= LAYERS - 1, scatters


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_ragged_future_outside_program_order_is_the_compilers_to_schedule(name):
  # What the README says of ragged_all_to_all_start outside program_order:
  # libtpu makes the real op async by itself, around the independent matmul;
  # the H100 compiler keeps it synchronous. When either changes, this fails.
  t = target(name)

  def f(x, w):
    future = _start("ragged_all_to_all", x, t.n)
    y = jnp.tanh(w @ w)
    return (future.done().sum() + y.sum())[None]
  not_async._warned.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = compiled_text(_smap(t, f, (P("x"), P())),
                         arg(t, (16 * t.n, 16), P("x")), arg(t, (16, 16)))
  pairs = _async(text, "ragged-all-to-all")
  if t.is_tpu:
    assert len(pairs) == 1 and pairs[0].matmuls >= 1, schedule.windows(text)
  else:
    assert not pairs, pairs
  assert any("ragged_all_to_all_start on" in str(w.message) for w in caught)


@needs_pairs
@pytest.mark.parametrize("kind", ["psum_scatter", "all_to_all"])
@pytest.mark.subprocess
def test_the_async_pair_still_crashes_libtpu(kind):
  # Why these futures are lowered synchronously on TPU: the async pair under
  # an ordered block kills the compiler (run apart, so a SIGSEGV fails only
  # this test). When a libtpu fixes it, this fails: drop the route.
  target("tpu_v5e")
  out = compilers.compile_in_subprocess(f"""
      from jax_overlap._src.xla import futures as lowering
      from jax_overlap._src.collectives import tpu_forms
      lowering._sync_on_this_platform = lambda ctx, op: False
      tpu_forms.wanted = lambda name: False   # the plain pair, not the TPU form
      import real_compilers_test as rt
      text, _ = rt._compiled("tpu_v5e", "future", {kind!r})
      print("compiled")
      """)
  assert out.returncode != 0 and "compiled" not in out.stdout, out.stderr[-2000:]


# --- fsdp_scan -------------------------------------------------------------------

#: (test, target) -> why the overlap asked for is not there today. The test
#: compiles, checks what it can, and xfails with this reason while short.
SHORT_TODAY: dict = {}
if OLDER:
  # jax < 0.12: the explicit mesh's moves are reshards on TPU, left to XLA
  # (the futures form there, plain collectives started in one shard_map and
  # read in the next, overlapped little: docs/compilers.md).
  SHORT_TODAY["explicit", "tpu_v5e"] = (
      f"fsdp_scan on an Explicit mesh with jax {jax.__version__}: the moves are "
      "jax.reshard (the futures form overlaps little there: 0 of 42 forward "
      "permutes), and TPU v5e compiles every gather synchronous at these "
      "sizes; open (issue 16)")


#: jax < 0.12 (quirks "gpu-plain-future" / "tpu-plain-future"): (test,
#: target) -> (what is in flight there, measured, why not all). The test
#: asserts at least that many; it fails when the count falls, and says so
#: when it reaches what jax 0.12 gives (drop the entry then). (Empty: every
#: cell the older lanes run is at jax 0.12's count.)
OLDER_IN_FLIGHT: dict = {}


def _short(test, name, got, wanted):
  if OLDER and (test, name) in OLDER_IN_FLIGHT:
    floor, why = OLDER_IN_FLIGHT[test, name]
    assert got >= floor, (test, name, got, floor)
    assert got < wanted, (f"jax {jax.__version__}: {got} of {wanted} in flight "
                          f"now; drop OLDER_IN_FLIGHT[{test!r}, {name!r}]")
    pytest.xfail(f"jax {jax.__version__}: {got} of {wanted} in flight "
                 f"(at least {floor}): {why}")
  if got < wanted and (test, name) in SHORT_TODAY:
    pytest.xfail(f"{SHORT_TODAY[test, name]} (measured {got} of {wanted})")


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_a100",
                                  "gpu_h100_2x8"])
def test_fsdp_scan_forward_gathers_the_next_layer_behind_this_one(name):
  text, warned = _compile(name, "fsdp", False)
  # (v5p: each gather is N-1 permutes, collectives/permute_forms.py.)
  gathers = _gathers(text, name)
  # Every layer's gathers but the first layer's are in flight across matmuls.
  got, wanted = sum(w.matmuls >= 1 for w in gathers), (LAYERS - 1) * WEIGHTS
  _short("forward", name, got, wanted)
  assert got >= wanted, gathers
  assert not warned, warned


@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
def test_fsdp_scan_has_ys_keeps_the_windows(name):
  """Per-layer outputs ride in the carry (fsdp_scan(has_ys=True)): the
  gathers and reduce-scatters stay in flight as without them."""
  if OLDER:
    pytest.skip("jax < 0.12 lowers each future's pair back to back: no "
                "window to keep (test_fsdp_scan_forward_... says so there)")
  text, warned = _compile(name, "fsdp", True, False, True, 1, True)
  gathers = _gathers(text, name)
  wanted = 2 * (LAYERS - 1) * WEIGHTS - (1 if name.startswith("tpu") else 0)
  assert sum(w.matmuls >= 1 for w in gathers) >= wanted, gathers
  if name == "gpu_h100":
    assert not warned, warned
    scatters = _scatters(text, name)
    assert sum(w.matmuls >= 1 for w in scatters) >= (LAYERS - 1) * WEIGHTS, \
        scatters


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_a100",
                                  "gpu_h100_2x8"])
def test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters(name):
  text, warned = _compile(name, "fsdp", True)
  gathers = _gathers(text, name)
  scatters = _scatters(text, name)
  is_tpu = name == "tpu_v5e"
  if is_tpu:
    # A plain async reduce-scatter crashes libtpu: on v5e the TPU form (an
    # all-to-all) stands for it, one in flight at a time, so with a gather
    # and a scatter a weight (bucket=False) some are finished where they
    # start, and that is said ...
    assert not scatters
    # (jax < 0.12: each form's all-to-all is left to libtpu, nothing said.)
    assert OLDER or any("psum_scatter_start" in m and "tpu" in m for m in warned), warned
    # ... and only as the future it is, not also as a fenced plain collective.
    assert not any("inside an ordered block" in m for m in warned), warned
  # Forward and backward: all but the first layer's gathers of each pass
  # (measured with libtpu 0.0.52: one fewer, 11 of the 12 expected; on v5e
  # 11 of its 16 gathers are async at all; on v5p, where each is N-1
  # permutes, layer 0's two regathers have no matmul in flight).
  if not is_tpu:
    # (v5p: psum_scatter_start is N-1 permutes, async, and nothing is said;
    # each step's but the last in flight since the modules holding them get
    # libtpu's experimental scheduler features, xla/compile_options.py:
    # 4 of 6 without, libtpu 0.0.52.)
    assert not warned, warned
    got = sum(w.matmuls >= 1 for w in scatters)
    _short("backward scatters", name, got, (LAYERS - 1) * WEIGHTS)
    assert got >= (LAYERS - 1) * WEIGHTS, scatters
  wanted = 2 * (LAYERS - 1) * WEIGHTS - (1 if name.startswith("tpu") else 0)
  got = sum(w.matmuls >= 1 for w in gathers)
  _short("backward", name, got, wanted)
  assert got >= wanted, gathers


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
def test_fsdp_scan_buckets_overlap_the_reduce_scatters_on_tpu(name):
  # One reduce-scatter a layer (the default, bucket=True) in its TPU form
  # (v5e: an all-to-all; v5p: N-1 permutes): each but the last (of the
  # pass) has the layer's matmuls in flight, and every gather but each
  # pass's first; nothing is said (measured with libtpu 0.0.52: v5e 3 of 4
  # and 6 of 6; v5p 3 of 4 and 7 of 9, layer 0's regather with nothing in
  # flight, as in the test above).
  text, warned = _compile(name, "fsdp", True, True)
  if OLDER:
    pytest.skip("jax < 0.12 lowers each future's pair back to back")
  if name == "tpu_v5p":
    forms, gathers = _scatters(text, name), _gathers(text, name)
    assert len(forms) == LAYERS, forms
  else:
    forms, gathers = _runs(text, "all-to-all"), _runs(text, "all-gather")
  assert sum(w.matmuls >= 1 for w in forms) >= LAYERS - 1, forms
  assert sum(w.matmuls >= 1 for w in gathers) >= 2 * (LAYERS - 1), gathers
  assert not warned, warned


def _weights_moved(text, windows):
  """How many weights the windows with a matmul move: GPU combines a
  layer's partitioner-made gathers (and reduce-scatters) into one
  collective of a tuple, one operand a weight."""
  comps = schedule.scheduled(text)
  return sum(len(comps[w.computation][w.start].operands)
             for w in windows if w.matmuls >= 1)


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_a100"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_fsdp_scan_on_an_explicit_mesh(name, grad):
  # As the shard_map context: each weight's gather but the first layer's
  # (each pass) in flight across matmuls, and each reduce-scatter but the
  # last layer's. On GPU each step's moves are tied into it
  # (xla/gpu_ties.py); without the ties H100 combined every
  # layer's gather into one before the loop (0 of 6 weights, and 0 of 11
  # and 0 of 6 for value_and_grad), and A100 (latency-hiding scheduler off
  # in its spec, on for modules with ties) made them synchronous. On TPU
  # v5e the moves are futures (explicit_futures.py); as reshards left to XLA
  # (jax < 0.12 there) v5e compiled every gather synchronous at these sizes.
  text, warned = _compile(name, "fsdp_explicit", grad)
  passes = 2 if grad else 1
  v5p = name == "tpu_v5p" and not OLDER
  gathers = _gathers(text, name)
  got = (sum(w.matmuls >= 1 for w in gathers) if v5p else
         _weights_moved(text, gathers))
  wanted = passes * (LAYERS - 1) * WEIGHTS
  if grad:
    # Layer 0's backward does not read "a" (x's cotangent is not asked
    # for), so XLA drops that regather: 11 moved of 12 (H100).
    wanted -= 1
  # Where the compiler does not overlap them (TPU), the user is told so at
  # the call (a warning that must go once it does).
  said = any("fsdp_scan on an explicit mesh" in m for m in warned)
  assert said == (got < wanted), (said, got, wanted, warned)
  _short("explicit", name, got, wanted)
  assert got >= wanted, gathers
  if grad and not name.startswith("tpu"):
    scatters = _runs(text, "reduce-scatter")
    assert _weights_moved(text, scatters) >= (LAYERS - 1) * WEIGHTS, scatters
  if grad and name.startswith("tpu"):
    # On TPU (jax 0.12) the moves are futures in shard_maps over the fsdp
    # axis around the global-mode layer (patterns/fsdp/explicit_futures.py);
    # a layer's gradients travel in one reduce-scatter in its TPU form (an
    # all-to-all, one in flight at a time): each but the last layer's has
    # the layer's matmuls in flight (measured, libtpu 0.0.52: 3 of 3, and
    # 11 of 11 gathers, 6 of 6 forward).
    forms = _scatters(text, name) if v5p else _runs(text, "all-to-all")
    assert sum(w.matmuls >= 1 for w in forms) >= LAYERS - 1, forms


@needs_pairs
def test_fsdp_scan_buckets_keep_their_windows_on_h100():
  # One gather a layer (both weights in one bucket) and one reduce-scatter:
  # all but the first gather of each pass, and all but the last scatter,
  # are in flight across matmuls.
  text, warned = _compiled("gpu_h100", "fsdp", True, True)
  gathers = _runs(text, "all-gather")
  scatters = _runs(text, "reduce-scatter")
  # (+ 1: layer 0's two weights are gathered apart, b behind a's matmul:
  # the stack's ends split by use order, patterns/fsdp/use_order.py)
  assert len(gathers) == 2 * LAYERS + SPLIT + _again(
      reshard_after_forward=True), gathers
  assert sum(w.matmuls >= 1 for w in gathers) >= 2 * (LAYERS - 1), gathers
  assert sum(w.matmuls >= 1 for w in scatters) >= LAYERS - 1, scatters
  assert not warned, warned


def _computes(instr) -> bool:
  # A matmul, also where GPU fused it with a transpose and named the fusion
  # after that (op_name ".../transpose", fusion "gemm_fusion_transpose").
  return instr.is_matmul or "gemm" in instr.name


@needs_pairs
@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_fsdp_scan_ends_hide_the_first_gather_and_the_last_reduce_scatter(name):
  # fsdp_scan(before=, after=): every gather of both passes (the first
  # behind the input projection; with reshard_after_forward=True the
  # backward's first, the last layer's regather, behind the head's backward,
  # which the default, 1, does not run: the last layer's weights are kept)
  # and every reduce-scatter, the last behind the projection's backward, has
  # a matmul in flight (v5e: the TPU form, an all-to-all). Written around
  # the call instead, the last one has none (measured, jax 0.12.0.1, libtpu
  # 0.0.52: H100 compiles it synchronous, v5e with nothing in its window).
  scatter = "all-to-all" if name.startswith("tpu") else "reduce-scatter"
  last = {}
  for ends, reshard in ((False, None), (True, None), (True, True)):
    text, warned = _compiled(name, "fsdp_ends", ends, reshard)
    gathers = _runs(text, "all-gather")
    # (layer 0's, the last, outside the loops)
    scatters = _runs(text, scatter)
    again = _again(**({} if reshard is None else
                      dict(reshard_after_forward=reshard)))
    outside = sorted((w for w in scatters if w.computation == "ENTRY"),
                     key=lambda w: w.done)
    last[ends, reshard] = sum(map(_computes, outside[-1].between)) \
        if len(scatters) == LAYERS + again else 0
    assert not warned, warned
    if ends:
      kept = 0 if reshard is True else 1
      # (+ SPLIT: layer 0's second weight gathered behind its first matmul)
      assert len(gathers) == 2 * LAYERS - kept + SPLIT + again, \
          (reshard, gathers)
      assert all(any(map(_computes, w.between)) for w in gathers), gathers
      assert len(scatters) == LAYERS + again, scatters
      assert all(any(map(_computes, w.between)) for w in scatters), scatters
  assert last[False, None] == 0, last
  assert last[True, None] >= 1 and last[True, True] >= 1, last


@needs_pairs
@pytest.mark.parametrize("name,reshard,prefetch", [
    ("gpu_h100", 1, 1), ("gpu_h100", False, 1), ("gpu_h100", True, 2),
    ("tpu_v5e", 1, 2)])
def test_fsdp_scan_memory_knobs_keep_their_windows(name, reshard, prefetch):
  # reshard_after_forward / prefetch (buckets on): every forward gather but
  # the first, and every backward regather (with none kept: all but the
  # first), in flight across matmuls; on GPU every reduce-scatter but the
  # last too. A kept layer is not regathered at all.
  text, warned = _compiled(name, "fsdp", True, True, reshard, prefetch)
  kept = 0 if reshard is True else LAYERS if reshard is False else reshard
  gathers = _runs(text, "all-gather")
  regathers = LAYERS - kept - (1 if kept == 0 else 0)
  assert sum(w.matmuls >= 1 for w in gathers) >= LAYERS - 1 + regathers, \
      gathers
  if name == "gpu_h100":
    # (layer 0 split by use order where one layer is kept and prefetch=1)
    split = SPLIT if reshard in (1, True) and prefetch == 1 else 0
    again = _again(reshard_after_forward=reshard, prefetch=prefetch)
    assert len(gathers) == 2 * LAYERS - kept + split + again, gathers
    scatters = _runs(text, "reduce-scatter")
    assert sum(w.matmuls >= 1 for w in scatters) >= LAYERS - 1, scatters
  assert not warned, warned


@needs_pairs
def test_fsdp_scan_memory_knobs_temp_bytes_on_h100():
  # The compiled step's temp bytes (memory_analysis) on the H100 compiler,
  # 6 layers of two 256 x 256 float32 weights (weights dominate), in units
  # of one gathered layer, against every layer regathered
  # (reshard_after_forward=True): keeping the last layer (the default) is
  # free (the backward pass holds its weights first anyway); prefetch=2
  # holds one more gathered layer and no more, prefetch=3 one more again.
  # Measured 4.87 layers for the default, +0.83 and +0.72 (jax 0.12.0.1);
  # before the steps' dones were fenced in (patterns/fsdp/transfer.py) and
  # the pipelined steps' gathers held to their step (pipelined.py): 6.63,
  # +1.60 and +1.50.
  t = target("gpu_h100")
  n, width = 6, 256
  w = arg(t, (n, width, width), P(None, "x"))
  args = (arg(t, (8 * t.n, width), P("x")), {"a": w, "b": w})
  spec = {"a": P(None, "x"), "b": P(None, "x")}

  def temp(**kw):
    def loss(x, ps):
      return jax_overlap.fsdp_scan(_layer, x, ps, axis="x", **kw).sum()[None]
    fwd = _smap(t, loss, (P("x"), spec))
    step = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
    compiled = jax.jit(step).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (2 * width * width * 4)
  default = temp(reshard_after_forward=True)   # every layer regathered
  keep_last = temp()                           # fsdp_scan's default, 1
  prefetch_2 = temp(reshard_after_forward=True, prefetch=2)
  # prefetch=3 here gathered layers 2 and 3 by the same op in both passes
  # until the backward pass read the stack through a barrier: XLA merged
  # the two starts, and the verifier refused one start with two dones.
  prefetch_3 = temp(reshard_after_forward=True, prefetch=3)
  assert keep_last <= default + 0.1, (default, keep_last)
  # What the step holds besides the weights' shards: a gathered layer in
  # use, the next in flight, a layer's gradient and the one being
  # reduce-scattered, and the buckets' packing copies; 6.63 when the
  # dones were free to sink.
  assert default <= 5.5, default
  # Each layer more ahead: about one gathered layer (the heap's packing
  # moves it by a few tenths), never the 1.6 it was.
  assert 0.5 <= prefetch_2 - default <= 1.1, (default, prefetch_2)
  assert 0.5 <= prefetch_3 - prefetch_2 <= 1.1, (prefetch_2, prefetch_3)


@needs_pairs
def test_fsdp_scan_needs_the_raised_overlap_limit_on_h100():
  # Premise of the option the library adds (xla/compile_options.py):
  # with XLA's own limit of one collective in flight, the H100 compile fails.
  t = target("gpu_h100")
  fn, args = fsdp_program(t, False)
  with pytest.raises(Exception, match="kExceedsOverlapLimit"):
    compiled_text(fn, *args, compiler_options={
        "xla_gpu_experimental_parallel_collective_overlap_limit": 1})


# --- collective matmul ---------------------------------------------------------

#: (target, which, grad) -> why not every permute has a block matmul between.
#: (Empty: TPU v5p's all_gather_matmul backward was at 13 of 14 until
#: program_order fenced an equation after an input-free one after the
#: equation before that too; ordering/barriers.py.)
PERMUTES_SHORT: dict = {}


def _collective_matmul_cases():
  for name in ("tpu_v5e", "tpu_v5p", "gpu_h100", "gpu_h100_2x8"):
    for which in ("all_gather_matmul", "matmul_reduce_scatter"):
      # 16 GPUs: the forward only (each backward costs 10-15 s there).
      for grad in (False,) if name == "gpu_h100_2x8" else (False, True):
        yield pytest.param(name, which, grad, id=(
            f"{'backward' if grad else 'forward'}-{which}-{name}"))
  # A100 (latency-hiding scheduler off in its spec): all_gather_matmul's
  # forward, whose permutes on jax < 0.12 hang on that scheduler staying off
  # (xla/compile_options.py).
  yield pytest.param("gpu_a100", "all_gather_matmul", False,
                     id="forward-all_gather_matmul-gpu_a100")


@pytest.mark.parametrize("name,which,grad", list(_collective_matmul_cases()))
def test_collective_matmul_sends_behind_block_matmuls(name, which, grad):
  text, warned = _compile(name, "collective_matmul", which, grad)
  permutes = _async(text, "collective-permute")
  n = target(name).n
  assert len(permutes) >= n - 1, schedule.windows(text)
  _short(f"{which} {'backward' if grad else 'forward'}", name,
         sum(w.matmuls >= 1 for w in permutes), len(permutes))
  if ((name, which, grad) in PERMUTES_SHORT
      and not all(w.matmuls >= 1 for w in permutes)):
    pytest.xfail(PERMUTES_SHORT[name, which, grad])
  assert all(w.matmuls >= 1 for w in permutes), permutes
  assert not warned, warned


# --- a data + tensor parallel block --------------------------------------------

@pytest.mark.parametrize("name", ["tpu_v5e", "gpu_h100"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["plain", "overlapped"])
def test_data_and_tensor_parallel_block_compiles(name, overlapped):
  # The library's sequence-parallel MLP (all_gather_matmul with a column-
  # sharded weight, then matmul_reduce_scatter, value_and_grad on a (data,
  # model) mesh). It used to be refused: v5e "Input and output buffer shapes
  # have different layout" for a rank-3 chunk's permute (the rings now send
  # matrices), H100 "Async start collective-permute-start is matched by
  # multiple async done instructions" (the forward's and the backward's
  # identical sends of x merged; each start now has its own channel).
  text, warned = _compile(name, "dp_tp", overlapped)
  assert not warned, warned
  if overlapped:
    # 4 devices on 'model': two rings of 3 sends in the forward, two in the
    # backward (w1's gather of x, w2's of dy; x's gradient is not asked
    # for); each send async with a block matmul in flight.
    permutes = _async(text, "collective-permute")
    assert len(permutes) == 12, schedule.windows(text)
    assert all(w.matmuls >= 1 for w in permutes), permutes
  else:
    # XLA's own: the plain all-gather and reduce-scatter over 'model' (no
    # permutes of ours).
    assert not _async(text, "collective-permute"), schedule.windows(text)
