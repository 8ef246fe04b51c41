"""What the library adds for the TPU and GPU compilers, checked on the lowered
module (no TPU or GPU compiler needed; tests/aot/ compiles for real)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_overlap
from jax_overlap import program_order
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async
from jax_overlap._src.xla import compile_options, module_marks

P = jax.P if hasattr(jax, "P") else jax.sharding.PartitionSpec
needs_split_pairs = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")


def _mesh():
  return jax.make_mesh((2,), ("i",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture
def tpu_forms_forced():
  """Traces choose the TPU forms on CPU too (collectives/tpu_forms.py)."""
  from jax_overlap._src.collectives import tpu_forms  # noqa: PLC0415
  with tpu_forms.forced():
    yield


def _lowered(body, platform, *args):
  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("i"), out_specs=P("i")))
  return f.trace(*args).lower(lowering_platforms=(platform,))


def _two_gathers(x):
  @program_order(enforce=True)
  def f(x):
    a = jax_overlap.all_gather_start(x, "i", tiled=True)
    b = jax_overlap.all_gather_start(x * 2, "i", tiled=True)
    return a.done() + b.done()
  return f(x)


def test_overlap_limits_for_each_platform():
  assert compile_options.overlap_options("cuda", {"all-gather": 2, "reduce-scatter": 2}) \
      == {compile_options.GPU_OVERLAP_LIMIT: 4}
  assert compile_options.overlap_options("tpu", {"all-gather": 3}) \
      == {compile_options.TPU_ALL_GATHER_LIMIT: 3}
  # On v5p an all_gather_start is N-1 permutes in flight (permute_forms.py).
  assert compile_options.overlap_options("tpu", {"collective-permute": 7}) \
      == {compile_options.TPU_PERMUTE_LIMIT: 7}
  assert compile_options.overlap_options("tpu", {"collective-permute": 1}) == {}
  assert compile_options.overlap_options("cuda", {"all-gather": 1}) == {}
  assert compile_options.overlap_options("cpu", {"all-gather": 4}) == {}


@needs_split_pairs
def test_module_with_futures_gets_the_limit_and_the_users_option_wins():
  module = _lowered(_two_gathers, "cuda", jnp.ones(8)).compiler_ir()
  assert module_marks.async_collective_starts(module) == {"all-gather": 2}
  assert compile_options._options_for(module, "cuda", {}) == {
      compile_options.GPU_OVERLAP_LIMIT: 2}
  assert compile_options._options_for(
      module, "cuda", {compile_options.GPU_OVERLAP_LIMIT: 1}) == {}
  assert compile_options._options_for(module, "cpu", {}) == {}


@pytest.mark.skipif(_compat.ASYNC_CUSTOM_CALLS,
                    reason="jax >= 0.12 lowers a future as an async pair")
def test_plain_futures_get_the_combiners_off():
  # jax < 0.12: the futures are plain collectives left to XLA's async
  # conversion (quirk "gpu-plain-future"): for GPU the module gets XLA's
  # combiners off (tests/aot/ shows what it changes on the H100 and A100
  # compilers; docs/compilers.md).
  module = _lowered(_two_gathers, "cuda", jnp.ones(8)).compiler_ir()
  assert module_marks.async_collective_starts(module) == {"all-gather": 2}
  assert compile_options._options_for(module, "cuda", {}) == {
      compile_options.GPU_OVERLAP_LIMIT: 2,
      **{k: 1 for k in compile_options.GPU_COMBINE_THRESHOLDS},
      compile_options.GPU_SOL_ESTIMATOR: False}
  cpu = _lowered(_two_gathers, "cpu", jnp.ones(8)).compiler_ir()
  assert compile_options._options_for(cpu, "cpu", {}) == {}


def _two_ppermutes(x):
  perm = [(0, 1), (1, 0)]

  @program_order(enforce=True)
  def f(x):
    a = jax_overlap.ppermute_start(x, "i", perm)
    b = jax_overlap.ppermute_start(x * 2, "i", perm)
    return a.done() + b.done()
  return f(x)


@needs_split_pairs
def test_v5p_permute_futures_get_libtpus_experimental_scheduler():
  # On v5p, with it, libtpu 0.0.52 keeps fsdp_scan's permute reduce-scatters
  # in flight across the next step's matmuls (without it, measured: 4 of 6
  # with one a weight, 2 of 3 with one weight over 4 layers; tests/aot/).
  module = _lowered(_two_ppermutes, "tpu", jnp.ones(8)).compiler_ir()
  assert module_marks.async_collective_starts(module) == {"collective-permute": 2}
  assert compile_options._options_for(module, "tpu", {}, device_kind="TPU v5") == {
      compile_options.TPU_PERMUTE_LIMIT: 2,
      compile_options.TPU_EXPERIMENTAL_SCHEDULER: True}
  # Not on other generations, and the user's own setting is kept.
  assert compile_options._options_for(
      module, "tpu", {}, device_kind="TPU v5 lite") == {
          compile_options.TPU_PERMUTE_LIMIT: 2}
  assert compile_options._options_for(
      module, "tpu", {compile_options.TPU_EXPERIMENTAL_SCHEDULER: False},
      device_kind="TPU v5") == {compile_options.TPU_PERMUTE_LIMIT: 2}


def test_the_hook_is_installed_once_a_future_is_lowered():
  from jax._src.interpreters import pxla
  from jax_overlap._src.xla import compile_hook
  with warnings.catch_warnings():
    # On jax < 0.12 a small gather's future is a synchronous all-reduce on
    # TPU, said once a process (tests/aot/real_compilers_test.py::
    # test_a_small_gather_over_two_axes_is_async_or_said); this test is about
    # the hook.
    warnings.simplefilter("ignore", jax_overlap.CollectiveNotAsyncWarning)
    _lowered(_two_gathers, "tpu", jnp.ones(8))
  assert compile_hook.installed()
  assert pxla.create_compile_options is not \
      compile_hook._ORIGINALS[pxla, "create_compile_options"]


@needs_split_pairs
@pytest.mark.parametrize("kind", ["psum_scatter", "psum", "all_to_all"])
def test_futures_tpu_cannot_take_async_lower_synchronously_with_a_warning(
    kind, monkeypatch):
  monkeypatch.setattr(not_async, "_warned", set())

  def body(x):
    @program_order(enforce=True)
    def f(x):
      if kind == "psum_scatter":
        fut = jax_overlap.psum_scatter_start(x, "i", tiled=True)
      elif kind == "psum":
        fut = jax_overlap.psum_start(x, "i")
      else:
        fut = jax_overlap.all_to_all_start(x, "i", 0, 0, tiled=True)
      return fut.done(), jnp.sin(x)
    a, b = f(x)
    return jnp.concatenate([a.reshape(-1), b.reshape(-1)])[:8]
  x = jnp.ones((16,))
  with pytest.warns(jax_overlap.CollectiveNotAsyncWarning,
                    match=f"{kind}_start on tpu"):
    text = _lowered(body, "tpu", x).as_text()
  assert "-start" not in text
  # GPU takes the pair.
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.CollectiveNotAsyncWarning)
    assert "-start" in _lowered(body, "cuda", x).as_text()


def test_fenced_synchronous_collective_is_found():
  def body(x):
    @program_order(enforce=True)
    def f(x):
      y = jnp.sin(x)
      return jax.lax.all_gather(y, "i", tiled=True)
    return f(x)[:8]
  module = _lowered(body, "cuda", jnp.ones(8)).compiler_ir()
  assert compile_options.fenced_sync_collectives(module) == ["all_gather"]
  plain = _lowered(lambda x: jax.lax.all_gather(jnp.sin(x), "i", tiled=True)[:8],
                   "cuda", jnp.ones(8)).compiler_ir()
  assert compile_options.fenced_sync_collectives(plain) == []

  # The block's first equation reads the block's inputs: fenced all the same.
  def first(x):
    @program_order(enforce=True)
    def f(x):
      return jax.lax.all_gather(x, "i", tiled=True), jnp.sin(x)
    g, y = f(x)
    return g[:8] + y.sum()
  module = _lowered(first, "cuda", jnp.ones(8)).compiler_ir()
  assert compile_options.fenced_sync_collectives(module) == ["all_gather"]


def test_a_collective_in_a_free_block_beside_work_is_left_to_xla():
  # README's quick start: a gather inside a free block with a matmul beside
  # it. The block's fences surround both, and XLA may overlap the two: not
  # "kept synchronous by the fences" (tests/aot/real_compilers_test.py::
  # test_a_gather_in_a_free_block_is_left_to_xla compiles it for v5e).
  def body(x):
    @program_order(enforce=True)
    def f(x):
      h = jnp.tanh(x)

      @program_order(enforce=False)
      def free(h, x):
        return jax.lax.all_gather(x, "i", tiled=True), jnp.tanh(h * h)
      g, h = free(h, x)
      return g[:8] + h.sum()
    return f(x)
  for platform in ("tpu", "cuda"):
    module = _lowered(body, platform, jnp.ones(8)).compiler_ir()
    assert compile_options.fenced_sync_collectives(module) == []

  # Alone in its free block, nothing is beside it: said.
  def alone(x):
    @program_order(enforce=True)
    def f(x):
      h = jnp.tanh(x)
      g = program_order(enforce=False)(
          lambda x: jax.lax.all_gather(x, "i", tiled=True))(x)
      return g[:8] + h.sum()
    return f(x)
  module = _lowered(alone, "tpu", jnp.ones(8)).compiler_ir()
  assert compile_options.fenced_sync_collectives(module) == ["all_gather"]


_REFUSAL = RuntimeError(
    "INTERNAL: FindAndExtractBestNodeAvailable failed to find a node to "
    "schedule, skipped nodes: all-to-all-done.2: Skipped due to "
    "kExceedsOverlapLimit.")


def _two_forms_in_turn(x):
  @program_order(enforce=True)
  def f(x):
    a = jax_overlap.all_to_all_start(x, "i", 0, 0, tiled=True)
    y = jnp.sin(x)
    b = jax_overlap.all_to_all_start(a.done() * 2, "i", 0, 0, tiled=True)
    z = jnp.cos(y)
    return b.done() + z
  return f(x)


def _form_windows(module) -> list[list[str]]:
  """The ops between each TPU-form start and its done, in module order."""
  windows, open_ = [], None
  for line in str(module).splitlines():
    if '@"all-to-all-start"' in line:
      open_ = []
    elif '@"all-to-all-done"' in line and open_ is not None:
      windows.append(open_)
      open_ = None
    elif open_ is not None and "stablehlo." in line:
      open_.append(line.split("stablehlo.", 1)[1].split(" ", 1)[0])
  return windows


@needs_split_pairs
def test_tpu_module_refused_for_two_all_to_alls_is_rewritten_once(monkeypatch,
                                                                 tpu_forms_forced):
  # libtpu refuses some schedules with two async all-to-alls in flight
  # ('kExceedsOverlapLimit'); only then are the forms finished where they
  # start, with a warning, and the module compiled again (tests/aot/ has
  # the real refusal).
  from jax_overlap._src.collectives import tpu_forms
  monkeypatch.setattr(not_async, "_warned", set())
  module = _lowered(_two_forms_in_turn, "tpu", jnp.ones((32, 4))).compiler_ir()
  before = _form_windows(module)
  assert len(before) == 2 and all("sine" in w or "cosine" in w for w in before), before
  # Nothing but that refusal, on TPU, is taken up.
  assert not compile_options._finish_forms_when_refused(module, "cuda", _REFUSAL)
  assert not compile_options._finish_forms_when_refused(
      module, "tpu", RuntimeError("INTERNAL: kExceedsOverlapLimit: all-gather-done.1"))
  assert not compile_options._finish_forms_when_refused(
      module, "tpu", RuntimeError("RESOURCE_EXHAUSTED: out of memory"))
  assert _form_windows(module) == before
  with pytest.warns(jax_overlap.CollectiveNotAsyncWarning, match="refused"):
    assert compile_options._finish_forms_when_refused(module, "tpu", _REFUSAL)
  assert _form_windows(module) == [[], []]
  # A module without forms (e.g. a plain gather's) has nothing to rewrite.
  with tpu_forms.forced(False):
    gathers = _lowered(_two_gathers, "tpu", jnp.ones(8)).compiler_ir()
  assert not compile_options._finish_forms_when_refused(gathers, "tpu", _REFUSAL)


def test_a_refused_compile_runs_again_only_when_a_hook_takes_it_up(monkeypatch):
  from jax_overlap._src.xla import compile_hook
  calls = []

  def compile_or_get_cached(backend, computation, *rest):
    calls.append(computation)
    if len(calls) == 1:
      raise _REFUSAL
    return "executable"
  wrapped = compile_hook._hooked_compile(compile_or_get_cached)
  backend = type("Backend", (), {"platform": "tpu"})()
  taken = []
  monkeypatch.setattr(compile_hook, "owns", lambda c: c == "module")
  monkeypatch.setattr(compile_hook, "_RETRY_HOOKS", [
      lambda c, p, e: taken.append((c, p, e)) or True])
  assert wrapped(backend, "module") == "executable"
  assert calls == ["module", "module"] and taken == [("module", "tpu", _REFUSAL)]
  # A module the library does not own is the user's: never retried.
  calls.clear()
  with pytest.raises(RuntimeError, match="kExceedsOverlapLimit"):
    wrapped(backend, "theirs")
  assert calls == ["theirs"] and len(taken) == 1
  calls.clear()
  monkeypatch.setattr(compile_hook, "_RETRY_HOOKS", [lambda c, p, e: False])
  with pytest.raises(RuntimeError, match="kExceedsOverlapLimit"):
    wrapped(backend, "module")
  assert calls == ["module"]


def _two_blocks_of_one_form(x):
  def step(x):
    @program_order(enforce=True)
    def f(x):
      a = jax_overlap.all_to_all_start(x, "i", 0, 0, tiled=True)
      y = jnp.sin(x)
      return a.done() + y
    return f(x)
  return step(x) * step(jnp.cos(x))


def _reads(value, target: str, limit: int = 400) -> bool:
  """Whether `value` is computed from a custom call to `target`."""
  frontier, seen = [value], 0
  while frontier and seen < limit:
    v = frontier.pop()
    seen += 1
    owner = v.owner
    if not hasattr(owner, "name") and not hasattr(owner, "operation"):
      continue   # a block argument
    op = owner.operation if hasattr(owner, "operation") else owner
    if op.name == "stablehlo.custom_call" and target in str(op.attributes["call_target_name"]):
      return True
    frontier.extend(op.operands)
  return False


def _form_starts(module):
  from jax_overlap._src.xla import form_rewrites
  return form_rewrites.form_starts(module)


@needs_split_pairs
def test_each_tpu_form_start_is_tied_after_the_previous_done(monkeypatch,
                                                             tpu_forms_forced):
  # libtpu allows one async all-to-all in flight; untied, XLA may hoist the
  # next start above the previous done and libtpu refuses the module
  # (measured: fsdp_scan's backward over 4 layers, tests/aot/).
  from jax_overlap._src.xla import all_to_all_slots, form_rewrites
  monkeypatch.setattr(not_async, "_warned", set())
  # As where jax lowers each step of fsdp_scan's unrolled backward apart and
  # splices them together (then lowering's own tie sees no previous done in
  # the block): here, lowering's tie turned off.
  monkeypatch.setattr(all_to_all_slots, "after_last_all_to_all", lambda ctx, x: x)
  module = _lowered(_two_blocks_of_one_form, "tpu", jnp.ones((32, 4))).compiler_ir()
  first, second = _form_starts(module)
  assert not _reads(second.operands[0], "all-to-all-done")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_overlap.CollectiveNotAsyncWarning)
    compile_options._options_for(module, "tpu", {}, device_kind="TPU v5 lite")
  first, second = _form_starts(module)   # still in flight: forms, tied
  assert not _reads(first.operands[0], "all-to-all-done")
  assert _reads(second.operands[0], "all-to-all-done")
  assert [w for w in _form_windows(module)] and all(_form_windows(module))
  # Where libtpu aborts on several (v5p) or was not measured: finished at once.
  other = _lowered(_two_blocks_of_one_form, "tpu", jnp.ones((32, 4))).compiler_ir()
  with pytest.warns(jax_overlap.CollectiveNotAsyncWarning, match="TPU v5\\)"):
    compile_options._options_for(other, "tpu", {}, device_kind="TPU v5")
  assert not _form_starts(other) and _form_windows(other) == [[], []]
  assert form_rewrites.chain_form_starts(other) == 0


@pytest.mark.skipif(not (hasattr(jax, "reshard")
                         and hasattr(jax.sharding, "AxisType")),
                    reason="this jax lacks AxisType.Explicit or jax.reshard")
def test_fsdp_scan_on_an_explicit_mesh_is_tied_for_gpu_only():
  # Lowered for GPU, each step's reshards are tied into it (two barriers a
  # step: xla/gpu_ties.py), and the module gets the GPU bound
  # on collectives in flight raised to that and the latency-hiding
  # scheduler on; lowered for CPU there is no tie (tests/aot checks what the
  # H100 and A100 compilers make of it).
  from jax_overlap._src.xla import gpu_ties as explicit_ties  # noqa: PLC0415
  mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))
  x = sharded(jnp.ones((4, 8)), P("i"))
  w = sharded(jnp.ones((3, 8, 8)), P(None, "i"))
  loss = lambda x, w: jax_overlap.fsdp_scan(
      lambda x, w: jnp.tanh(x @ w), x, w, axis="i").sum()
  f = jax.jit(jax.value_and_grad(loss, argnums=1))
  use_mesh = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
  with use_mesh(mesh):
    gpu = f.trace(x, w).lower(lowering_platforms=("cuda",)).compiler_ir()
    cpu = f.trace(x, w).lower(lowering_platforms=("cpu",)).compiler_ir()
  ties = explicit_ties.count(gpu)
  assert ties >= 4 and ties % 2 == 0, ties
  assert explicit_ties.count(cpu) == 0
  assert compile_options._options_for(gpu, "cuda", {}) == {
      compile_options.GPU_OVERLAP_LIMIT: ties,
      compile_options.GPU_LATENCY_HIDING: True}
  assert compile_options._options_for(cpu, "cpu", {}) == {}


@pytest.mark.skipif(_compat.ASYNC_CUSTOM_CALLS,
                    reason="jax 0.12 lowers a future as its async pair, not "
                    "as the plain collective XLA places itself")
def test_gpu_plain_futures_get_the_latency_hiding_scheduler_with_a_loop_or_psum():
  # jax < 0.12: the A100 spec has XLA's latency-hiding scheduler off; its
  # memory scheduler kept all_gather_matmul's straight-line permutes in
  # flight (7 of 7, which the latency-hiding scheduler made 0 of 7) but put
  # fsdp_scan's first steps' starts next to their dones once the layers ran
  # in loops, and psum_start's matmul before its start
  # (tests/aot/real_compilers_test.py, the A100 cells in OLDER_JAX_EXTRA).
  def psum(x):
    @program_order(enforce=True)
    def f(x):
      s = jax_overlap.psum_start(x, "i")
      return s.done() + jnp.tanh(x)
    return f(x)
  summed = _lowered(psum, "cuda", jnp.ones(8)).compiler_ir()
  assert compile_options._options_for(summed, "cuda", {})[
      compile_options.GPU_LATENCY_HIDING] is True
  def looped(x):
    def body(x, _):
      return _two_gathers(x)[: x.shape[0]] * 0.5, None
    return jax.lax.scan(body, x, None, length=2)[0]
  straight = _lowered(_two_gathers, "cuda", jnp.ones(8)).compiler_ir()
  loop = _lowered(looped, "cuda", jnp.ones(8)).compiler_ir()
  lhs = compile_options.GPU_LATENCY_HIDING
  assert lhs not in compile_options._options_for(straight, "cuda", {})
  assert compile_options._options_for(loop, "cuda", {})[lhs] is True
  assert compile_options._options_for(loop, "cuda", {lhs: False}).get(lhs) is None
  assert lhs not in compile_options._options_for(loop, "cpu", {})


@pytest.mark.skipif(_compat.ASYNC_CUSTOM_CALLS,
                    reason="jax 0.12 lowers a future as its async pair, not "
                    "as the plain collective XLA places itself")
def test_gpu_modules_of_futures_only_get_the_sol_estimator_off():
  # jax < 0.12 (quirk "gpu-plain-future-estimator"): with XLA's speed-of-
  # light estimate H100 put all_gather_matmul's block matmuls before their
  # sends' starts; a module that also holds a collective of its own (here a
  # psum outside program_order, as a weight gradient's) keeps XLA's estimate
  # (tests/aot/real_compilers_test.py, the H100 cells of the older subset).
  def mixed(x):
    return _two_gathers(x)[: x.shape[0]] + jax.lax.psum(x, "i")
  sol = compile_options.GPU_SOL_ESTIMATOR
  only = _lowered(_two_gathers, "cuda", jnp.ones(8)).compiler_ir()
  both = _lowered(mixed, "cuda", jnp.ones(8)).compiler_ir()
  assert compile_options._options_for(only, "cuda", {})[sol] is False
  kept = compile_options._options_for(both, "cuda", {})
  assert sol not in kept, kept
  # ... and today's other choices for a plain-future module.
  assert all(kept[k] == 1 for k in compile_options.GPU_COMBINE_THRESHOLDS), kept
  assert sol not in compile_options._options_for(only, "cuda", {sol: True})
  assert sol not in compile_options._options_for(only, "cpu", {})
