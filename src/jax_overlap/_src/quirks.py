"""Every compiler workaround the library applies, in one table.

Invariant: code that works around a TPU or GPU compiler asks `applies(name,
platform, device_kind)` here, never matches device kinds itself, and each
row names the compiler versions it is tested with and the test that pins
it. The first time a row applies under a compiler version outside its range,
the library still applies it and warns once, naming the version
(tests/ordering/quirks_test.py). The compiler's version is read at run time from its
installed package.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import warnings

from jax_overlap._src.collectives.not_async import CollectiveNotAsyncWarning

#: The installed package of each compiler the table names.
PACKAGES = {"libtpu": "libtpu", "cuda": "jax-cuda12-plugin"}
_GPU = ("cuda", "rocm", "gpu")


@dataclasses.dataclass(frozen=True)
class Quirk:
  name: str
  platform: str              # "tpu" or "gpu"
  device_kinds: frozenset | None   # device_kind strings; None: every one
  compiler: str              # a key of PACKAGES
  tested: tuple[str, str]    # the versions tested, lowest and highest
  does: str                  # what the library does, and why
  test: str                  # the test that pins it


def _kinds(*names):
  return frozenset(names)


#: libtpu 0.0.42.1 / 0.0.44.1 turn a plain all-gather of a shard under this
#: many bytes into a synchronous all-reduce (row "tpu-plain-permute-gathers";
#: measured on v5e: 256 bytes sync, 512 async).
SMALL_PLAIN_TPU_GATHER_BYTES = 512

# "TPU v5 lite" is v5e, "TPU v5" is v5p (their device_kind strings).
TABLE = (
    Quirk("tpu-collective-forms", "tpu", None, "libtpu", ("0.0.42.1", "0.0.52"),
          "psum_scatter_start, psum_start and all_to_all_start start an "
          "all-to-all (their TPU form; psum_start's is a reduce-scatter in "
          "psum_scatter_start's form, then the summed chunk gathered in "
          "all_gather_start's): an async reduce-scatter crashes the "
          "compiler (AsyncCollectiveReplacer) and an async all-reduce is not "
          "implemented",
          "tests/aot/real_compilers_test.py::test_the_async_pair_still_crashes_libtpu"),
    Quirk("tpu-permute-forms", "tpu", _kinds("TPU v5"), "libtpu",
          ("0.0.52", "0.0.52"),
          "all_gather_start and psum_scatter_start are N-1 collective-permute "
          "futures, and so are both halves of psum_start's ring: v5p "
          "compiles every all-gather synchronous",
          "tests/aot/tpu_forms_compiled_test.py"),
    Quirk("tpu-plain-permute-gathers", "tpu", _kinds("TPU v5 lite"), "libtpu",
          ("0.0.42.1", "0.0.44.1"),
          "on jax < 0.12 (tpu-plain-future) all_gather_start is N-1 "
          "collective-permutes, as tpu-permute-forms: libtpu there turns "
          "small plain all-gathers (SMALL_PLAIN_TPU_GATHER_BYTES) into "
          "all-reduces of dynamic-update-slices and combines them into one "
          "synchronous all-reduce; psum_start's ring gathers its summed "
          "chunk by these permutes too",
          "tests/aot/real_compilers_test.py::"
          "test_fsdp_scan_forward_gathers_the_next_layer_behind_this_one"),
    Quirk("tpu-sync-all-gather", "tpu", _kinds("TPU v5"), "libtpu",
          ("0.0.52", "0.0.52"),
          "an all_gather_start with no permute form gets its all-to-all "
          "form (psum_start's ring never needs it: its all-gather half is "
          "always permutes there): the plain all-gather compiles "
          "synchronous there",
          "tests/aot/tpu_forms_compiled_test.py"),
    Quirk("tpu-forms-in-flight", "tpu", _kinds("TPU v5 lite"), "libtpu",
          ("0.0.52", "0.0.52"),
          "a module's TPU forms are chained one after another so that one "
          "all-to-all is in flight at a time (the compiler allows one); "
          "elsewhere they are finished where they start",
          "tests/aot/real_compilers_test.py::"
          "test_fsdp_scan_backward_overlaps_regathers_and_reduce_scatters"),
    Quirk("tpu-fsdp-permutes-beside-all-to-alls", "tpu", _kinds("TPU v5 lite"),
          "libtpu", ("0.0.52", "0.0.52"),
          "where fsdp_scan's layer starts all-to-all futures of its own (an "
          "expert stream's exchanges), fsdp_scan's gathers and "
          "reduce-scatters are permute futures (as tpu-permute-forms): the "
          "compiler keeps one async all-to-all in flight, and a reduce-scatter "
          "form held across a layer's backward left the layer's exchanges to "
          "run synchronous, and they it",
          "tests/aot/moe_compiled_test.py::"
          "test_fsdp_beside_an_expert_stream_keeps_every_collective_async"),
    Quirk("tpu-permute-scheduler", "tpu", _kinds("TPU v5"), "libtpu",
          ("0.0.52", "0.0.52"),
          "modules with several permute futures get "
          "xla_tpu_enable_all_experimental_scheduler_features: without it "
          "some reduce-scatters finished before the next step's matmuls",
          "tests/aot/real_compilers_test.py::"
          "test_fsdp_scan_buckets_overlap_the_reduce_scatters_on_tpu"),
    Quirk("tpu-flat-all-gather", "tpu", None, "libtpu", ("0.0.42.1", "0.0.52"),
          "an all_gather_start of a rank >= 2 operand gathers it as one flat "
          "buffer, reshaped after the done: layout assignment may lay the "
          "gathered result out column-major, and the compiler aborts "
          "(RET_CHECK IsMajorDimAllGather)",
          "tests/aot/major_dim_compiled_test.py"),
    Quirk("gpu-plain-future", "gpu", None, "cuda", ("0.10.2", "0.11.0"),
          "on jax < 0.12 a future's start is the plain collective, its result "
          "kept out of program_order's barriers until its done: the plugin "
          "refuses the async region ('vhlo.async_start_v1'), and XLA's own "
          "async conversion puts the written work in the window; such "
          "modules get XLA's collective combiners off (threshold 1 byte): "
          "they merged fsdp_scan's first two layers' gathers into one; those "
          "holding a loop or a psum_start get the latency-hiding scheduler "
          "on: A100's spec has it off, and its memory scheduler put "
          "fsdp_scan's first steps' starts next to their dones and "
          "psum_start's matmul before its start (in straight-line permute "
          "modules it keeps all_gather_matmul's permutes in flight, the "
          "latency-hiding scheduler does not)",
          "tests/aot/real_compilers_test.py::"
          "test_future_is_an_async_pair_around_the_matmul"),
    Quirk("gpu-plain-future-estimator", "gpu", None, "cuda", ("0.10.2", "0.11.0"),
          "on jax < 0.12 (gpu-plain-future) a module whose every collective "
          "is a future's plain collective gets "
          "xla_gpu_enable_analytical_sol_latency_estimator off: with it H100's "
          "latency-hiding scheduler put all_gather_matmul's block matmuls "
          "before their sends' starts at small sizes (and, jax 0.11.0, "
          "psum_start's matmul before its start); a module holding XLA's or "
          "the user's own collectives too keeps XLA's estimate",
          "tests/aot/real_compilers_test.py::"
          "test_collective_matmul_sends_behind_block_matmuls"),
    Quirk("tpu-plain-future", "tpu", None, "libtpu", ("0.0.42.1", "0.0.44.1"),
          "as gpu-plain-future; libtpu there makes the all-gather, permute "
          "and all-to-all (with xla_tpu_enable_async_all_to_all) async, and "
          "keeps the all-reduce and reduce-scatter synchronous",
          "tests/aot/real_compilers_test.py::"
          "test_future_is_an_async_pair_around_the_matmul"),
    Quirk("tpu-switch-rows-in-branch", "tpu", None, "libtpu",
          ("0.0.52", "0.0.52"),
          "pipeline_loss's switch ticks write their row buffers (kept "
          "inputs, cotangents, residuals) in their branches, from zeros, "
          "as before (patterns/pipeline/row_writes.py): elsewhere a branch "
          "gives its rows back to be written after the conditional, which "
          "on the H100 removed XLA's copies of every buffer a conditional "
          "returns (bench 1F1B with the weights gathered once 10.1 -> 8.7 "
          "ms modelled) but cost XLA:TPU more (v5e DualPipeV 15.4 -> 24.3 "
          "ms, 19.2 with the gradient rows added to in their branches; 1F1B "
          "14.1 -> 15.3 ms)",
          "tests/aot/pipeline_compiled_test.py::"
          "test_switch_ticks_write_their_rows_after_the_conditional"),
    Quirk("tpu-pipeline-tick-gate", "tpu", None, "libtpu",
          ("0.0.52", "0.0.52"),
          "on jax >= 0.12 pipeline_loss's lockstep ticks read their "
          "parameters through an optimization barrier with the loss the "
          "tick before starts from (xla/tick_gate.py): without it XLA:TPU "
          "starts every tick's FSDP weight gathers, which need only the "
          "parameters, near the program's start (v5e 1F1B bench temp 3,112 "
          "-> 2,051 MiB with it; v5p's permute gathers likewise); on older "
          "jax (libtpu 0.0.42.1, 0.0.44.1) the gathers are plain-future "
          "permutes that stayed in their tick "
          "without it, and the row is not asked",
          "tests/aot/pipeline_compiled_test.py::"
          "test_lockstep_ticks_gather_their_weights_one_tick_ahead_at_most"),
    Quirk("gpu-flat-permute", "gpu", None, "cuda", ("0.12.0.1", "0.12.0.1"),
          "ppermute_start of a rank >= 2 operand sends it as one flat "
          "row-major buffer, reshaped after the done: where layout "
          "assignment gives the operand a non-default layout (a pipeline's "
          "(batch, seq, width) activation beside ring attention in the "
          "stage) layout normalization puts bitcasts into the async "
          "computation and the compile fails ('Asynchronous computation ... "
          "expected to contain only the root and parameter instructions'); "
          "a rank-1 buffer has one layout",
          "tests/aot/pipeline_compiled_test.py::"
          "test_lockstep_stages_keep_their_sends_in_flight"),
    Quirk("gpu-flat-all-reduce", "gpu", None, "cuda", ("0.12.0.1", "0.12.0.1"),
          "psum_start of a rank >= 2 operand sums it as one flat buffer, "
          "reshaped after the done, as gpu-flat-permute sends one: the sum "
          "of a matmul's result (matmul_psum's chunks) failed to compile "
          "the same way ('Asynchronous computation ... expected to contain "
          "only the root and parameter instructions')",
          "tests/aot/matmul_psum_compiled_test.py"),
    Quirk("gpu-overlap-limit", "gpu", None, "cuda", ("0.10.2", "0.12.0.1"),
          "modules with several futures in flight get "
          "xla_gpu_experimental_parallel_collective_overlap_limit raised to "
          "their count: at the default 1 the compile fails "
          "(kExceedsOverlapLimit)",
          "tests/aot/real_compilers_test.py::"
          "test_fsdp_scan_needs_the_raised_overlap_limit_on_h100"),
)
_BY_NAME = {q.name: q for q in TABLE}


def applies(name: str, platform: str | None, device_kind: str | None = None) -> bool:
  """Whether quirk `name` applies to a compile for `platform` /
  `device_kind` (warning once where the compiler's version is untested)."""
  quirk = _BY_NAME[name]
  here = "gpu" if platform in _GPU else platform
  if here != quirk.platform:
    return False
  if quirk.device_kinds is not None and device_kind not in quirk.device_kinds:
    return False
  _check_version(quirk)
  return True


def kinds(name: str) -> frozenset:
  """The device kinds quirk `name` is for (empty where it is for every one)."""
  return _BY_NAME[name].device_kinds or frozenset()


@functools.cache
def compiler_version(compiler: str) -> str | None:
  """The installed version of `compiler` (a key of PACKAGES), or None."""
  try:
    return importlib.metadata.version(PACKAGES[compiler])
  except importlib.metadata.PackageNotFoundError:
    return None


def _version_key(version: str) -> tuple:
  parts = []
  for p in version.split("."):
    digits = "".join(c for c in p if c.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


_warned: set[str] = set()


def _check_version(quirk: Quirk) -> None:
  version = compiler_version(quirk.compiler)
  if version is None or quirk.name in _warned:
    return
  low, high = (_version_key(v) for v in quirk.tested)
  if low <= _version_key(version) <= high:
    return
  _warned.add(quirk.name)
  warnings.warn(
      f"jax_overlap: {PACKAGES[quirk.compiler]} {version} is outside the "
      f"versions its workaround '{quirk.name}' was measured on "
      f"({quirk.tested[0]} to {quirk.tested[1]}); it is applied all the same "
      f"({quirk.does}). Check the compiled schedule ({quirk.test} shows how), "
      "and report what you find.", CollectiveNotAsyncWarning, stacklevel=3)
