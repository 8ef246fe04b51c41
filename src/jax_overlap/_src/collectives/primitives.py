"""The two primitives every collective is made of, their evaluation and vmap.

* `collective_start_p(x, *aux; comm)` -> `(in_flight, operand)`: `in_flight`
  has the collective's result type; `operand` is `x` passed through, a slot for
  autodiff (see `autodiff.py`). `aux` are the collective's integer arguments
  (a ragged all-to-all's offsets and sizes; none for the other collectives).
* `collective_done_p(in_flight[, operand, *aux]; comm)` -> the result. `aux`
  comes along with the operand slot, for the transpose to start with.
"""

from __future__ import annotations

import jax
from jax._src import core
from jax._src.interpreters import batching

from jax_overlap._src import _compat

from jax_overlap._src.collectives.comm import Comm
from jax_overlap._src.eager_shard_map import EagerAwarePrimitive


collective_start_p = EagerAwarePrimitive("collective_start")
collective_start_p.multiple_results = True
collective_done_p = EagerAwarePrimitive("collective_done")


def _start_abstract_eval(x_aval, *aux_avals, comm):
  del x_aval, aux_avals
  return [comm.flight_aval, comm.in_aval], comm.jaxpr.effects


collective_start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _done_abstract_eval(in_flight, *operand, comm):
  del operand
  if comm.tpu_form is not None:
    return comm.out_aval
  return in_flight


collective_done_p.def_abstract_eval(_done_abstract_eval)


# Where nothing is staged (an eager shard_map, or an eager vmap whose
# collective became local math) the start runs the collective to the end at
# once and the done hands the value over. Such a future is watched instead:
# one dropped without done() is reported when it is collected.
def _start_eagerly(x, *aux, comm):
  comm.state.watch()
  if comm.tpu_form is None:
    jaxpr = comm.jaxpr_for((_eager_platform(),))
  else:
    jaxpr = comm.tpu_form.start
  run = core.jaxpr_as_fun(jaxpr)
  if aux:
    # A collective of many ops (the ragged all-to-all's CPU form): one
    # compiled call, not one dispatch an op.
    run = jax.jit(run)
  (y,) = run(x, *aux)
  return [y, x]


def _eager_platform() -> str:
  """The platform an eager collective runs on: the mesh's, where jax says."""
  platform, _ = _compat.trace_device()
  return platform or jax.default_backend()


def _done_eagerly(in_flight, *operand, comm):
  del operand
  if comm.tpu_form is not None:
    (in_flight,) = core.jaxpr_as_fun(comm.tpu_form.done)(in_flight)
  return in_flight


collective_start_p.def_impl(_start_eagerly)
collective_start_p.def_eager_shard_map(_start_eagerly)
collective_done_p.def_impl(_done_eagerly)
collective_done_p.def_eager_shard_map(_done_eagerly)
# A block's cached program (eager_shard_map.py) stands in for the start's
# eager rule: the new future is watched all the same.
collective_start_p.def_replay(lambda comm: comm.state.watch())


def _comm_key(key, comm):
  # Everything but the future's state, which is new at every trace.
  return (comm.name, key(comm.jaxpr), key(comm.tpu_form),
          key(comm.cpu_jaxpr), comm.sync_note)


collective_start_p.def_cache_key(_comm_key)
collective_done_p.def_cache_key(_comm_key)


def start(comm: Comm, x, *aux):
  in_flight, operand = collective_start_p.bind(x, *aux, comm=comm)
  return in_flight, operand


def finish(in_flight, operand, comm: Comm, aux=()):
  args = (in_flight,) if operand is None else (in_flight, operand, *aux)
  return collective_done_p.bind(*args, comm=comm)


# --- vmap ------------------------------------------------------------------------------

def _batched(comm: Comm, axis_data) -> Comm:
  """`comm` on operands batched at dim 0. The start and its done each make
  it; both get the same jaxpr (jax memoizes `batch_jaxpr`) and state, so the
  done's transpose sees the batched types."""
  every = [True] * (1 + comm.n_aux)
  jaxpr, _ = batching.batch_jaxpr(comm.jaxpr, axis_data, every, [True])
  cpu = comm.cpu_jaxpr
  if cpu is not None:
    cpu, _ = batching.batch_jaxpr(cpu, axis_data, every, [True])
  form = comm.tpu_form
  if form is not None:
    form = type(form)(
        batching.batch_jaxpr(form.start, axis_data, [True], [True])[0],
        batching.batch_jaxpr(form.done, axis_data, [True], [True])[0],
        local=form.local)
  return Comm(comm.name, jaxpr, comm.state, form, cpu)


def _at_front(x, d, size):
  """`x` batched at dim 0 (broadcast there if it is not batched)."""
  if d is None:
    return batching.broadcast(x, size, 0, None)
  return batching.moveaxis(x, d, 0)


def _start_batch(axis_data, args, dims, *, comm):
  if all(d is None for d in dims):
    return collective_start_p.bind(*args, comm=comm), [None] * 2
  args = [_at_front(a, d, axis_data.size) for a, d in zip(args, dims)]
  outs = collective_start_p.bind(*args, comm=_batched(comm, axis_data))
  return outs, [0, 0]


def _done_batch(axis_data, args, dims, *, comm):
  in_flight, *operand = args
  d, *operand_dims = dims
  if d is None:
    return collective_done_p.bind(in_flight, comm=comm), None
  args = [batching.moveaxis(in_flight, d, 0)]
  if operand and operand_dims[0] is not None:
    args.append(batching.moveaxis(operand[0], operand_dims[0], 0))
    args.extend(_at_front(a, ad, axis_data.size)
                for a, ad in zip(operand[1:], operand_dims[1:]))
  # (An unbatched operand slot is dropped, with its aux: it only carries
  # autodiff.)
  return collective_done_p.bind(*args, comm=_batched(comm, axis_data)), 0


batching.fancy_primitive_batchers[collective_start_p] = _start_batch
batching.fancy_primitive_batchers[collective_done_p] = _done_batch
