"""Compile options for modules that hold async collective futures.

The latency-hiding schedulers of the TPU and GPU compilers bound how many
async collectives may be in flight at once, and a module whose fenced order
starts more than that fails to compile instead of running them in turn:
`FindAndExtractBestNodeAvailable failed to find a node to schedule ...
kExceedsOverlapLimit`. `fsdp_scan` does (the next layer's gathers, one per
weight, while this layer computes; in the backward pass the regathers and the
gradient reduce-scatters too), and so may any program of futures.

For a module compiled for TPU or GPU that holds more than one future start,
the library raises those bounds to the number of starts in the module (an
upper bound on what can be in flight), unless the user passed the option
themselves (then theirs is kept as given):

* GPU: `xla_gpu_experimental_parallel_collective_overlap_limit` (XLA's default 1);
* TPU: `xla_max_concurrent_async_all_gathers` (libtpu's default 1), and for
  collective-permutes `xla_max_concurrent_async_collective_permutes`
  (libtpu's default 1: on v5p an `all_gather_start` or `psum_scatter_start`
  is N-1 permutes in flight at once, collectives/permute_forms.py, which
  fails to compile with `kExceedsOverlapLimit` on a
  `collective-permute-done` without it).

On TPU v5p (quirks.py, "tpu-permute-scheduler") such a module also gets
`xla_tpu_enable_all_experimental_scheduler_features=True`: without it the
compiler's latency-hiding scheduler finishes some of fsdp_scan's permute
reduce-scatters before the next step's matmuls though nothing holds them
there (docs/compilers.md has the counts; tests/aot/real_compilers_test.py::
test_fsdp_scan_buckets_overlap_the_reduce_scatters_on_tpu pins it).

A TPU module that holds an async all-to-all (the TPU form of
`psum_scatter_start`, `psum_start` and `all_to_all_start`, on v5p of
`all_to_all_start`, and of `psum_start` where its ring does not apply:
collectives/tpu_forms.py) also gets
`xla_tpu_enable_async_all_to_all=True`: without it the TPU compiler crashes
on the pair (SIGSEGV), with it the all-to-all is async on v5e and v5p
(tests/aot/tpu_forms_compiled_test.py::
test_the_form_needs_the_async_all_to_all_option). The compiler allows one
async all-to-all in flight (no option raises it), so in a TPU module
holding several such futures:

* on v5e (quirks.py, "tpu-forms-in-flight"), each form's start is tied after
  the all-to-all finished before it in its block
  (`form_rewrites.chain_form_starts`): lowering ties those it lowers into one
  block, but jax lowers each step of an unrolled scan apart, and the
  compiler refuses fsdp_scan's backward untied. Tied, each reduce-scatter
  but the last has a matmul in flight (tests/aot/tpu_forms_compiled_test.py::
  test_fsdp_scan_backward_reduce_scatters_overlap_the_matmuls_on_tpu).
  Should the compiler still refuse a module for two in flight
  (`kExceedsOverlapLimit` on an all-to-all-done), the forms are finished
  where they start and it is compiled again (`_finish_forms_when_refused`, a
  retry hook on jax's compile; warned; tests/aot/tpu_forms_compiled_test.py,
  `-k refuses_compiles_again`);
* elsewhere (v5p, where the compiler aborts on some modules holding several
  forms in flight, tied or not; generations quirks.py does not name), each
  is finished where it starts before the compile, warned
  (tests/aot/tpu_forms_compiled_test.py::
  test_several_all_to_all_forms_on_v5p_are_finished_at_once). On v5p
  fsdp_scan's gathers and reduce-scatters are permutes, so this is left to
  programs with several `all_to_all_start` futures (or `psum_start`s of a
  scalar).

A GPU module holding `fsdp_scan`'s tied steps on an explicit mesh
(`gpu_ties.py`) gets the GPU bound raised to the number of
ties (two a step), as if each were a start: a backward step has the
partitioner's gather and reduce-scatter in flight at once. It also gets
`xla_gpu_enable_latency_hiding_scheduler=True` (the scheduler that places the
tied collectives; the A100 spec has it off), and so does a GPU module that
holds a loop or a psum_start and a future's plain collective (jax < 0.12,
quirks.py "gpu-plain-future"), whose start and done XLA places itself. A GPU
module whose every collective is such a plain collective gets XLA's
speed-of-light latency estimator off (quirks.py "gpu-plain-future-estimator").

Other modules compile exactly as XLA would
(tests/ordering/compile_options_test.py; the real compilers' checks are in
tests/aot/, over the compiler versions quirks.py's rows name).
"""

from __future__ import annotations

from typing import Any

from jax._src.lib.mlir import ir

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives import not_async
from jax_overlap._src.ordering import block_collectives
from jax_overlap._src.xla import compile_hook, form_rewrites, gpu_ties, module_marks

GPU_OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
GPU_LATENCY_HIDING = "xla_gpu_enable_latency_hiding_scheduler"
GPU_SOL_ESTIMATOR = "xla_gpu_enable_analytical_sol_latency_estimator"
#: XLA:GPU's combiners, off (1 byte) for modules holding plain futures.
GPU_COMBINE_THRESHOLDS = tuple(
    f"xla_gpu_{kind}_combine_threshold_bytes"
    for kind in ("all_gather", "reduce_scatter", "all_reduce"))
TPU_ALL_GATHER_LIMIT = "xla_max_concurrent_async_all_gathers"
TPU_ASYNC_ALL_TO_ALL = "xla_tpu_enable_async_all_to_all"
TPU_PERMUTE_LIMIT = "xla_max_concurrent_async_collective_permutes"
TPU_EXPERIMENTAL_SCHEDULER = "xla_tpu_enable_all_experimental_scheduler_features"
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def overlap_options(platform: str, starts: dict[str, int]) -> dict[str, Any]:
  """The options a module with `starts` (kind -> count) gets on `platform`."""
  total = sum(starts.values())
  if total > 1 and quirks.applies("gpu-overlap-limit", platform):
    return {GPU_OVERLAP_LIMIT: total}
  options: dict[str, Any] = {}
  if platform == "tpu" and starts.get("all-gather", 0) > 1:
    options[TPU_ALL_GATHER_LIMIT] = starts["all-gather"]
  if platform == "tpu" and starts.get("collective-permute", 0) > 1:
    options[TPU_PERMUTE_LIMIT] = starts["collective-permute"]
  if platform == "tpu" and starts.get("all-to-all", 0) > 0:
    options[TPU_ASYNC_ALL_TO_ALL] = True
  return options


_SYNC_COLLECTIVES = {
    "stablehlo.all_gather": "all_gather", "stablehlo.all_reduce": "psum",
    "stablehlo.reduce_scatter": "psum_scatter",
    "stablehlo.all_to_all": "all_to_all",
    "stablehlo.collective_permute": "ppermute"}


def _is_barrier(op) -> bool:
  op = op.operation if hasattr(op, "operation") else op
  return op.name == "stablehlo.optimization_barrier"


def _feeds_a_barrier(op) -> bool:
  try:
    return any(_is_barrier(use.owner) for r in op.results for use in r.uses)
  except AttributeError:  # bindings without Value.uses: say it, as before
    return True


#: Ops that are no work to overlap a collective with.
_NO_WORK_OPS = frozenset({
    "stablehlo.constant", "stablehlo.optimization_barrier",
    "stablehlo.create_token", "stablehlo.after_all", "stablehlo.partition_id",
    "stablehlo.replica_id", "func.return", "stablehlo.return", "sdy.return"})


def _op(x):
  return x.operation if hasattr(x, "operation") else x


def _producer(value):
  """The op that made `value`, or None for a block argument."""
  owner = value.owner
  return None if isinstance(owner, ir.Block) else _op(owner)


def _has_company(collective) -> bool:
  """Whether work that neither feeds `collective` nor uses its result
  reaches a barrier it feeds without crossing a barrier: work written beside
  it between the same fences (a free block's compute), which XLA may overlap
  it with. In an ordered block each equation has fences of its own, so a
  collective there has none. Where the bindings cannot follow uses, None
  found (said, as before)."""
  collective = _op(collective)
  try:
    fences = [_op(use.owner) for r in collective.results for use in r.uses
              if _is_barrier(use.owner)]
    after = _reach(collective, forward=True)
    before = _reach(collective, forward=False)
    for fence in fences:
      for op in _reach(fence, forward=False):
        if op == collective or op in before or op in after:
          continue
        if op.name not in _NO_WORK_OPS and len(op.operands) > 0:
          return True
  except AttributeError:  # bindings without Value.uses
    return False
  return False


def _reach(op, forward: bool) -> set:
  """The ops reached from `op` through uses (`forward`) or operands, stopping
  at barriers and block arguments."""
  seen: set = set()
  todo = [op]
  while todo:
    cur = todo.pop()
    if forward:
      nexts = [_op(use.owner) for r in cur.results for use in r.uses]
    else:
      nexts = [p for p in map(_producer, cur.operands) if p is not None]
    for n in nexts:
      if n in seen or n == op:
        continue
      seen.add(n)
      if not _is_barrier(n):
        todo.append(n)
  return {n for n in seen if not _is_barrier(n)}


def _reads_a_barrier(op) -> bool:
  """Whether the first of `op`'s operands that an operation made (not a block
  argument) is an `optimization_barrier`'s result."""
  for operand in op.operands:
    if not isinstance(operand.owner, ir.Block):
      return _is_barrier(operand.owner)
  return False


def fenced_sync_collectives(computation) -> list[str]:
  """The synchronous collectives of an MLIR module fenced on both sides,
  feeding an `optimization_barrier` and either reading one's result, as every
  collective inside an ordered block does (barriers.py fences the outputs of
  one that ends a block), or, where it starts the block and reads the block's
  inputs, bound in `block_collectives.FENCED_SCOPE`. One that only reads a block's
  result, after it, is left to XLA and not said; nor is a future that had to
  be lowered synchronously (it was said already); nor one with work beside it
  between its fences (`_has_company`: a collective in a free block,
  `program_order(enforce=False)`, written beside compute that XLA may
  overlap it with; tests/aot/real_compilers_test.py::
  test_a_gather_in_a_free_block_is_left_to_xla)."""
  found: list[str] = []

  def visit(op):
    if (op.name in _SYNC_COLLECTIVES
        and not_async.SYNC_FUTURE_ATTR not in op.attributes
        and module_marks.IN_FLIGHT_ATTR not in op.attributes
        and (block_collectives.FENCED_SCOPE in str(op.location) or _reads_a_barrier(op))
        and _feeds_a_barrier(op) and not _has_company(op)):
      found.append(_SYNC_COLLECTIVES[op.name])
    return ir.WalkResult.ADVANCE
  try:
    computation.operation.walk(visit)
  except AttributeError:  # not an MLIR module
    return []
  return found


def _options_for(computation, platform: str, user_options, *,
                 device_kind: str | None = None) -> dict[str, Any]:
  if platform not in (*_GPU_PLATFORMS, "tpu"):
    return {}
  if platform == "tpu" and _compat.ASYNC_CUSTOM_CALLS and _form_count(computation) > 1:
    if quirks.applies("tpu-forms-in-flight", platform, device_kind):
      _chain_forms(computation)
    else:
      _finish_forms_at_once(computation, device_kind)
  fenced = fenced_sync_collectives(computation)
  if fenced:
    not_async.warn_fenced_sync_collective(platform, fenced)
  starts = module_marks.async_collective_starts(computation)
  ties = _explicit_fsdp_ties(computation) if platform in _GPU_PLATFORMS else 0
  if ties:
    # fsdp_scan on an explicit mesh: each tied step may have a gather and a
    # reduce-scatter of XLA's partitioner in flight (gpu_ties.py).
    starts = {**starts, "fsdp-explicit-step": ties}
  wanted = overlap_options(platform, starts)
  if (starts.get("collective-permute", 0) > 1
      and quirks.applies("tpu-permute-scheduler", platform, device_kind)):
    wanted[TPU_EXPERIMENTAL_SCHEDULER] = True
  if (platform in _GPU_PLATFORMS and _holds_plain_futures(computation)
      and quirks.applies("gpu-plain-future", platform)):
    # jax < 0.12: the futures are plain collectives (futures.py),
    # which XLA's combiners merge when nothing orders them (fsdp_scan's first
    # step starts layer 0's and layer 1's gathers together: one gather, done
    # before the first matmul); each stays the future it was written as.
    wanted.update({k: 1 for k in GPU_COMBINE_THRESHOLDS})
    if (_only_future_collectives(computation)
        and quirks.applies("gpu-plain-future-estimator", platform)):
      # Every collective is a future written to overlap: XLA's speed-of-light
      # estimate put small ones' written matmul before their start. XLA's own
      # collectives keep its estimate, and so do modules holding them too
      # (docs/compilers.md). Pinned by real_compilers_test.py::
      # test_collective_matmul_sends_behind_block_matmuls[forward-all_gather_matmul-gpu_h100]
      # and test_future_is_an_async_pair_around_the_matmul[psum-gpu_h100].
      wanted[GPU_SOL_ESTIMATOR] = False
    if _holds_a_loop(computation) or _holds_plain_all_reduce(computation):
      # With the latency-hiding scheduler off (the A100 spec) the memory
      # scheduler places each plain start: it closed fsdp_scan's windows
      # outside its loops and psum_start's window before its matmul, while in
      # straight-line permute modules it keeps windows the latency-hiding
      # scheduler would close (all_gather_matmul's forward).
      # Pinned by real_compilers_test.py::
      # test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters[gpu_a100]
      # and test_future_is_an_async_pair_around_the_matmul[psum-gpu_a100].
      wanted[GPU_LATENCY_HIDING] = True
  if ties:
    # XLA's latency-hiding scheduler places the tied collectives around
    # their step's compute; a target that has it off (the A100 spec) runs
    # each one synchronously (docs/compilers.md, the A100 rows).
    wanted[GPU_LATENCY_HIDING] = True
  return {k: v for k, v in wanted.items() if k not in (user_options or {})}


def _holds_plain_futures(computation) -> bool:
  """Whether the module holds a future's plain collective
  (`module_marks.IN_FLIGHT_ATTR`, jax < 0.12)."""
  if _compat.ASYNC_CUSTOM_CALLS:
    return False
  return module_marks.holds(computation, lambda op: module_marks.IN_FLIGHT_ATTR in op.attributes)


#: The MLIR collectives (and ragged all-to-all's custom call) XLA runs.
_COLLECTIVE_OPS = (*_SYNC_COLLECTIVES, "stablehlo.collective_broadcast")


def _only_future_collectives(computation) -> bool:
  """Whether every collective of the module is a future's plain collective
  (`module_marks.IN_FLIGHT_ATTR`, jax < 0.12): none is XLA's or the user's own."""
  def xlas_own(op):
    if op.name == "stablehlo.custom_call":
      return "ragged_all_to_all" in str(op.attributes["call_target_name"])
    return op.name in _COLLECTIVE_OPS and module_marks.IN_FLIGHT_ATTR not in op.attributes
  return _holds_plain_futures(computation) and not module_marks.holds(computation, xlas_own)


def _holds_plain_all_reduce(computation) -> bool:
  """Whether the module holds a `psum_start`'s plain all-reduce (jax < 0.12)."""
  return module_marks.holds(computation, lambda op: op.name == "stablehlo.all_reduce"
                and module_marks.IN_FLIGHT_ATTR in op.attributes)


def _holds_a_loop(computation) -> bool:
  """Whether the module holds a `stablehlo.while`."""
  return module_marks.holds(computation, lambda op: op.name == "stablehlo.while")


def _explicit_fsdp_ties(computation) -> int:
  return gpu_ties.count(computation)


def _form_count(computation) -> int:
  try:
    return module_marks.async_collective_starts(computation).get("all-to-all", 0)
  except Exception:  # noqa: BLE001 - not an MLIR module
    return 0


def _chain_forms(computation) -> None:
  """Each TPU-form start tied after the all-to-all finished before it
  (`form_rewrites.chain_form_starts`): libtpu then keeps them one at a time."""
  with computation.context:
    form_rewrites.chain_form_starts(computation)


def _finish_forms_at_once(computation, device_kind) -> None:
  with computation.context:
    done = form_rewrites.finish_form_starts_at_once(computation)
  if done:
    not_async.warn_once("tpu:several-all-to-alls", (
        f"{done} futures on tpu ({device_kind or 'unknown generation'}) in one "
        "compiled program are in their TPU form (psum_scatter_start, "
        "psum_start, all_to_all_start: an "
        "all-to-all each); the TPU compiler allows one async all-to-all at a "
        "time, and on this generation the compiler aborts on some programs "
        "holding several in flight (v5p), so each runs synchronously here "
        "(values unchanged). A program with one such future keeps it in "
        "flight; on v5e several stay in flight. Silence with "
        "warnings.filterwarnings('ignore', "
        "category=jax_overlap.CollectiveNotAsyncWarning)."))


def refused_for_two_all_to_alls(error: BaseException) -> bool:
  """Whether a TPU compile error is libtpu's refusal to put a second async
  all-to-all in flight."""
  text = str(error)
  return "kExceedsOverlapLimit" in text and "all-to-all-done" in text


def _finish_forms_when_refused(computation, platform, error) -> bool:
  """A TPU module that libtpu refused because two of its TPU-form futures
  (an all-to-all each) would be in flight at once gets each finished where it
  starts, to be compiled again. Any other failure is left as it is."""
  if platform != "tpu" or not refused_for_two_all_to_alls(error):
    return False
  try:
    with computation.context:
      done = form_rewrites.finish_form_starts_at_once(computation)
  except AttributeError:  # not an MLIR module
    return False
  if not done:
    return False
  not_async.warn_once("tpu:several-all-to-alls", (
      f"{done} futures on tpu in one compiled program are in their TPU form "
      "(psum_scatter_start, psum_start, all_to_all_start; all_gather_start "
      "on v5p: an all-to-all each), and the TPU compiler refused the "
      "program's schedule because two of them would be in flight at once "
      "(it allows one async all-to-all; no option raises it: "
      "'kExceedsOverlapLimit'). They run synchronously in this program "
      "(values unchanged); a program that the compiler schedules one at a "
      "time keeps them in flight. Silence with warnings.filterwarnings('ignore', "
      "category=jax_overlap.CollectiveNotAsyncWarning)."))
  return True


compile_hook.add_options_hook(_options_for)
compile_hook.add_retry_hook(_finish_forms_when_refused)
