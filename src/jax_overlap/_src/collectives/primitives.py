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


collective_start_p = core.Primitive("collective_start")
collective_start_p.multiple_results = True
collective_done_p = core.Primitive("collective_done")


def _start_abstract_eval(x_aval, *, comm):
  del x_aval
  return [comm.out_aval, comm.in_aval], comm.jaxpr.effects


collective_start_p.def_effectful_abstract_eval(_start_abstract_eval)


def _done_abstract_eval(in_flight, *operand, comm):
  del operand, comm
  return in_flight


collective_done_p.def_abstract_eval(_done_abstract_eval)


# Outside any jit (e.g. an eager vmap whose collective became local math) the
# start computes the value at once and the done hands it over.
def _start_impl(x, *, comm):
  (y,) = core.jaxpr_as_fun(comm.jaxpr)(x)
  return [y, x]


collective_start_p.def_impl(_start_impl)
collective_done_p.def_impl(lambda in_flight, *operand, comm: in_flight)


def start(comm: Comm, x):
  in_flight, operand = collective_start_p.bind(x, comm=comm)
  return in_flight, operand


def finish(in_flight, operand, comm: Comm):
  args = (in_flight,) if operand is None else (in_flight, operand)
  return collective_done_p.bind(*args, comm=comm)


# --- vmap ------------------------------------------------------------------------------

def _start_batch(axis_data, args, dims, *, comm):
  (x,), (d,) = args, dims
  if d is None:
    return collective_start_p.bind(x, comm=comm), [None] * 2
  x = batching.moveaxis(x, d, 0)
  jaxpr, (out_batched,) = batching.batch_jaxpr(comm.jaxpr, axis_data, [True],
                                               [True])
  del out_batched
  outs = collective_start_p.bind(x, comm=Comm(comm.name, jaxpr, comm.state))
  return outs, [0, 0]


def _done_batch(axis_data, args, dims, *, comm):
  del axis_data
  d = dims[0]
  args = list(args)
  if len(args) == 2 and dims[1] != d:
    # The operand is only carried for autodiff; drop a mismatched one.
    args = args[:1]
  return collective_done_p.bind(*args, comm=comm), d


batching.fancy_primitive_batchers[collective_start_p] = _start_batch
batching.fancy_primitive_batchers[collective_done_p] = _done_batch
