"""The two primitives every collective is made of, their evaluation and vmap.

* `collective_start_p(x; comm)` -> `(in_flight, operand)`: `in_flight` has the
  collective's result type; `operand` is `x` passed through, a slot for
  autodiff (see `autodiff.py`).
* `collective_done_p(in_flight[, operand]; comm)` -> the result.
"""

from __future__ import annotations

from jax._src import core
from jax._src.interpreters import batching

from jax_overlap._src.collectives.comm import Comm
from jax_overlap._src.eager_shard_map import EagerAwarePrimitive


collective_start_p = EagerAwarePrimitive("collective_start")
collective_start_p.multiple_results = True
collective_done_p = EagerAwarePrimitive("collective_done")


def _start_abstract_eval(x_aval, *, comm):
  del x_aval
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
def _start_eagerly(x, *, comm):
  comm.state.watch()
  jaxpr = comm.jaxpr if comm.tpu_form is None else comm.tpu_form.start
  (y,) = core.jaxpr_as_fun(jaxpr)(x)
  return [y, x]


def _done_eagerly(in_flight, *operand, comm):
  del operand
  if comm.tpu_form is not None:
    (in_flight,) = core.jaxpr_as_fun(comm.tpu_form.done)(in_flight)
  return in_flight


collective_start_p.def_impl(_start_eagerly)
collective_start_p.def_eager_shard_map(_start_eagerly)
collective_done_p.def_impl(_done_eagerly)
collective_done_p.def_eager_shard_map(_done_eagerly)


def start(comm: Comm, x):
  in_flight, operand = collective_start_p.bind(x, comm=comm)
  return in_flight, operand


def finish(in_flight, operand, comm: Comm):
  args = (in_flight,) if operand is None else (in_flight, operand)
  return collective_done_p.bind(*args, comm=comm)


# --- vmap ------------------------------------------------------------------------------

def _batched(comm: Comm, axis_data) -> Comm:
  """`comm` on operands batched at dim 0. The start and its done each make
  it; both get the same jaxpr (jax memoizes `batch_jaxpr`) and state, so the
  done's transpose sees the batched types."""
  jaxpr, _ = batching.batch_jaxpr(comm.jaxpr, axis_data, [True], [True])
  form = comm.tpu_form
  if form is not None:
    form = type(form)(
        batching.batch_jaxpr(form.start, axis_data, [True], [True])[0],
        batching.batch_jaxpr(form.done, axis_data, [True], [True])[0])
  return Comm(comm.name, jaxpr, comm.state, form)


def _start_batch(axis_data, args, dims, *, comm):
  (x,), (d,) = args, dims
  if d is None:
    return collective_start_p.bind(x, comm=comm), [None] * 2
  x = batching.moveaxis(x, d, 0)
  outs = collective_start_p.bind(x, comm=_batched(comm, axis_data))
  return outs, [0, 0]


def _done_batch(axis_data, args, dims, *, comm):
  in_flight, *operand = args
  d, *operand_dim = dims
  if d is None:
    return collective_done_p.bind(in_flight, comm=comm), None
  args = [batching.moveaxis(in_flight, d, 0)]
  if operand and operand_dim[0] is not None:
    args.append(batching.moveaxis(operand[0], operand_dim[0], 0))
  # (An unbatched operand slot is dropped: it only carries autodiff.)
  return collective_done_p.bind(*args, comm=_batched(comm, axis_data)), 0


batching.fancy_primitive_batchers[collective_start_p] = _start_batch
batching.fancy_primitive_batchers[collective_done_p] = _done_batch
