"""`all_gather_start` and `psum_scatter_start` on TPU v5p (and
`all_gather_start` on v5e with jax < 0.12), as collective-permutes in flight
at once.

On v5p the TPU compiler compiles every all-gather synchronously, crashes on
an async reduce-scatter, and aborts on a module holding several of the
all-to-all forms of `tpu_forms.py` in flight (quirks.py, "tpu-permute-forms",
with the compiler versions it holds for). It does compile async
collective-permutes there, several at once once
`xla_max_concurrent_async_collective_permutes` allows it (set for such
modules by `xla/compile_options.py`; the compiler's default is one). So
on v5p, over an axis of N devices:

* `all_gather_start(x)`: N-1 permutes of `x`, the k-th to the device k
  places further along the axis (k = 1 .. N-1), all started at once; `done()`
  finishes them and puts the N shards (its own among them) in device order;
* `psum_scatter_start(x)`: N-1 permutes, the k-th sending the chunk that the
  device k places further owns to it; `done()` finishes them and sums the N
  contributions to its own chunk (its own first, then by shift).

Each device sends N-1 shards (chunks), the bytes of a ring, all of them in
flight while the code written before `done()` runs. The future is a
`composed.ComposedFuture` of `ppermute` futures, so everything the library
does with a ppermute (autodiff, vmap, program_order, the compile options)
holds for its parts. Values match `jax.lax` up to the order of the sum
(each chunk is summed on one device only, so no two devices can disagree):
tests/collectives/permute_forms_test.py checks values and gradients on CPU with `forced()`.

On v5e with jax < 0.12 (quirks.py, "tpu-plain-permute-gathers") the
all-gather future is otherwise its plain collective (xla/futures.py),
which libtpu there turns, at fsdp_scan's small sizes, into one synchronous
all-reduce; the permutes stay async (tests/aot/real_compilers_test.py,
`-k "fsdp and tpu_v5e"`, in the older aot venvs).

On the real compiler each part is an async pair around the matmul written
before `done()`, and fsdp_scan's gathers and reduce-scatters are in flight
as on v5e once the module gets the experimental scheduler features
(xla/compile_options.py): tests/aot/tpu_forms_compiled_test.py pins both
(docs/compilers.md has the counts). The parts share one operand (a
gather's); each permute start carries its config as its backend config so
that XLA's CSE keeps them apart (xla/futures.py;
`test_v5p_permute_parts_stay_apart_outside_program_order`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax._src import ad_util
from jax._src import core
from jax._src import source_info_util
from jax._src import traceback_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir

from jax_overlap._src import _compat, quirks
from jax_overlap._src.collectives import comm as comm_lib
from jax_overlap._src.collectives.comm import Comm, one_bound_axis, trace_sync
from jax_overlap._src.collectives.composed import ComposedFuture
from jax_overlap._src.collectives.future import Future, FutureState
from jax_overlap._src.collectives.primitives import finish, start

source_info_util.register_exclusion(__file__)
traceback_util.register_exclusion(__file__)

#: TPU generations (device_kind) whose all-gathers and reduce-scatters are
#: started as permutes (quirks.py, "tpu-permute-forms").
KINDS = quirks.kinds("tpu-permute-forms")
COLLECTIVES = ("all_gather", "psum_scatter")

#: Test switch: `with forced(): ...` chooses the forms on every platform.
_SWITCH = comm_lib.FormSwitch()
forced, is_forced = _SWITCH.forced, _SWITCH.is_forced

#: fsdp_scan's switch: `with beside_all_to_alls(): ...` chooses the forms
#: where the TPU's one all-to-all slot is wanted by the futures of the code
#: they are in flight over (quirks.py, "tpu-fsdp-permutes-beside-all-to-alls").
_BESIDE = comm_lib.FormSwitch()
beside_all_to_alls = _BESIDE.forced


def wanted(name: str) -> bool:
  """Whether a future of collective `name` started now is made of permutes
  (quirks "tpu-permute-forms", "tpu-plain-permute-gathers")."""
  if name not in COLLECTIVES:
    return False
  if is_forced():
    return True
  platform, kind = _compat.trace_device()
  if name == "all_gather" and not _compat.ASYNC_CUSTOM_CALLS and \
      quirks.applies("tpu-plain-permute-gathers", platform, kind):
    return True
  if _BESIDE.is_forced() and quirks.applies(
      "tpu-fsdp-permutes-beside-all-to-alls", platform, kind):
    return True
  return quirks.applies("tpu-permute-forms", platform, kind)


def _mesh_axes() -> tuple:
  try:
    return tuple(jax.sharding.get_abstract_mesh().axis_names)
  except Exception:  # noqa: BLE001 - no mesh: none
    return ()


def _shift(x, axis, n, k, name, where, second_half=False, first_half=False):
  """The ppermute future of `x` to the device `k` further along `axis`,
  reported (if never finished) as the future of `name`."""
  perm = tuple((j, (j + k) % n) for j in range(n))
  jaxpr = trace_sync(lambda v: lax.ppermute(v, axis, perm), x)
  state = FutureState(name, where)
  comm = Comm("ppermute", jaxpr, state, second_half=second_half,
              first_half=first_half)
  in_flight, operand = start(comm, x)
  return Future(in_flight, operand, state,
                lambda value, operand: finish(value, operand, comm))


def _rolled(stack, shift):
  """`stack` rolled by `shift` along its first axis, `shift` traced: slot j
  holds stack[(j - shift) % n] (one dynamic slice of the stack twice)."""
  n = stack.shape[0]
  doubled = jnp.concatenate([stack, stack], axis=0)
  return lax.dynamic_slice_in_dim(doubled, (n - shift % n) % n, n, axis=0)


def _gathered(axis, n, a, tiled, own, parts):
  # parts[k - 1] came from the device k places back, (i - k) % n: in the
  # order own, parts[n - 2], ..., parts[0], slot m holds device (i + m) % n's
  # shard, and rolled by i, slot j holds device j's.
  stack = _rolled(jnp.stack([own, *reversed(parts)]), lax.axis_index(axis))
  moved = jnp.moveaxis(stack, 0, a)
  if not tiled:
    return moved
  shape = list(own.shape)
  shape[a] *= n
  return moved.reshape(shape)


def _summed(d, tiled, own, parts):
  # Each device sums its own chunk's contributions, in shift order (own
  # first): the order of the sum differs from jax.lax's, the value does not
  # where the sum is exact.
  total = own
  for part in parts:
    total = total + part
  if not tiled:
    return total.reshape(total.shape[1:])
  return jnp.moveaxis(total, 0, d)


def compose(name: str, params: dict, x, where: str, *, invariant=False,
            second_half=False, first_half=False) -> Future | None:
  """The future of collective `name` (with the `jax.lax` call's `params`)
  on `x`, made of permutes; None where this form is not used (another
  platform, several or positional axes, a shape it cannot split).
  `invariant`: a tiled all-gather along axis 0 whose result is typed
  invariant over the axis, as `_compat.all_gather_invariant`'s
  (`gathered_invariant`); `second_half`: its parts are `Comm.second_half`
  starts (ring_psum.py's all-gather half); `first_half`: `Comm.first_half`
  (the reduce-scatter half of psum_start(to="varying")'s ring)."""
  if params is None or not wanted(name):
    return None
  bound = one_bound_axis(params.get("axis_name"))
  if bound is None:
    return None
  axis, n = bound
  if not is_forced() and axis not in _mesh_axes():
    return None   # a vmap axis: the plain future
  if n < 2 or x.size == 0:
    return None
  reference = _reference(name, params)
  if invariant:
    if name != "all_gather" or not params["tiled"] or params["axis"] != 0:
      return None
    reference = lambda v: _compat.all_gather_invariant(v, axis)
  out_aval = trace_sync(reference, x).out_avals[0]
  shift = functools.partial(_shift, axis=axis, n=n, name=name, where=where,
                            second_half=second_half, first_half=first_half)
  if name == "all_gather":
    tiled = params["tiled"]
    if params.get("to") is not None or (tiled and x.ndim == 0):
      return None
    a = params["axis"] % (x.ndim + (0 if tiled else 1)) if x.ndim else 0
    parts = [shift(x, k=k) for k in range(1, n)]
    combine = functools.partial(_gathered, axis, n, a, tiled)
    if invariant:
      combine = functools.partial(_gathered_invariant, combine, axis)
    return ComposedFuture(name, where, x, parts, combine, out_aval)
  # psum_scatter
  tiled = params["tiled"]
  if x.ndim == 0:
    return None
  d = params["scatter_dimension"] % x.ndim
  if x.shape[d] % n or (not tiled and x.shape[d] != n):
    return None
  xt = jnp.moveaxis(x, d, 0)
  chunks = xt.reshape(n, xt.shape[0] // n, *xt.shape[1:])
  # Slot k: the chunk owned by the device k places further, (i + k) % n.
  mine = _rolled(chunks, -lax.axis_index(axis))
  parts = [shift(mine[k], k=k) for k in range(1, n)]
  combine = functools.partial(_summed, d, tiled)
  return ComposedFuture(name, where, mine[0], parts, combine, out_aval)


def _reference(name, params):
  axis = params["axis_name"]
  if name == "all_gather":
    return lambda v: lax.all_gather(v, axis, axis=params["axis"],
                                    tiled=params["tiled"])
  return lambda v: lax.psum_scatter(
      v, axis, scatter_dimension=params["scatter_dimension"],
      tiled=params["tiled"])


# --- the gathered buffer typed invariant over the axis --------------------------------

def _gathered_invariant(combine, axis, own, parts):
  return gathered_invariant(own, combine(own, parts), axis)


def gathered_invariant(own, gathered, axis):
  """`gathered`, the tiled all-gather of `own` along axis 0 made by
  permutes, typed invariant over `axis` as `_compat.all_gather_invariant(own)`
  is, and differentiated as that op is: a device's cotangent is its own slice
  of the result's, and none goes back through the permutes. Every device
  holds the same buffer, so the type is true; jax cannot see it (a permute's
  result varies) and has no cast from varying to invariant. Values and
  gradients: tests/collectives/tpu_forms_test.py, psum_start's ring with its
  all-gather half as permutes."""
  return gathered_invariant_p.bind(own, gathered, axis=axis)


gathered_invariant_p = core.Primitive("gathered_invariant")
gathered_invariant_p.def_impl(lambda own, gathered, *, axis: gathered)
gathered_invariant_p.def_abstract_eval(
    lambda own, gathered, *, axis: _compat.invariant_over(gathered, axis))
mlir.register_lowering(gathered_invariant_p,
                       lambda ctx, own, gathered, *, axis: [gathered])


def _gathered_invariant_transpose(ct, own, gathered, *, axis):
  c = own.aval.shape[0]
  mine = lax.dynamic_slice_in_dim(ct, lax.axis_index(axis) * c, c, axis=0)
  return [mine if ad.is_undefined_primal(own) else None,
          ad_util.Zero(gathered.aval.to_ct_aval())
          if ad.is_undefined_primal(gathered) else None]


ad.deflinear2(gathered_invariant_p, _gathered_invariant_transpose)


def _gathered_invariant_batch(args, dims, *, axis):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  own, gathered = (batching.broadcast(a, size, 0, None) if d is None
                   else batching.moveaxis(a, d, 0) for a, d in zip(args, dims))
  # Batched at 0, the gather is along axis 1: moved to the front for the bind.
  out = gathered_invariant_p.bind(jnp.moveaxis(own, 0, 1),
                                  jnp.moveaxis(gathered, 0, 1), axis=axis)
  return jnp.moveaxis(out, 1, 0), 0


batching.primitive_batchers[gathered_invariant_p] = _gathered_invariant_batch
