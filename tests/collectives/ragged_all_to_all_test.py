"""ragged_all_to_all_start: values and gradients against a reference by hand.

XLA:CPU cannot run jax.lax.ragged_all_to_all (no jax has it there), so the
references here are numpy's (the documented send/receive loop) and a dense
one in jax ops (every device's rows gathered, the written rows picked by
masks), built independently of the library's CPU form.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo

from ragged_reference import dense_reference

N, M, W = 5, 6, 3   # operand rows, output rows, row width


def _mesh(n):
  return jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))


def _plan(size, per, seed):
  """Per-device int tables (input_offsets, send_sizes, output_offsets,
  recv_sizes), each (size, K): random consistent chunks, unsorted offsets,
  some rows of each output left unwritten."""
  rng = np.random.RandomState(seed)
  k = size * per
  send = np.zeros((size, k), np.int32)
  in_off = np.zeros((size, k), np.int32)
  for d in range(size):
    sizes = rng.multinomial(N - 1, np.ones(k) / k)   # at most N - 1 rows sent
    order = rng.permutation(k)
    start = 0
    for i in order:
      in_off[d, i], send[d, i] = start, sizes[i]
      start += sizes[i]
  # recv[dst, src*per + p] = send[src, dst*per + p]
  recv = np.zeros_like(send)
  out_off = np.zeros_like(send)
  for dst in range(size):
    slots = [(src, p) for src in range(size) for p in range(per)]
    order = rng.permutation(len(slots))
    at = int(rng.randint(0, 2))
    for j in order:
      src, p = slots[j]
      n = send[src, dst * per + p]
      recv[dst, src * per + p] = n
      out_off[src, dst * per + p] = at
      at += n
    assert at <= M
  return in_off, send, out_off, recv


def _numpy_reference(operands, outputs, in_off, send, out_off, recv):
  size, k = send.shape
  per = k // size
  results = [np.array(o, copy=True) for o in outputs]
  for d in range(size):
    for i in range(k):
      dst = i // per
      chunk = operands[d][in_off[d, i]:in_off[d, i] + send[d, i]]
      assert recv[dst, d * per + i % per] == len(chunk)
      results[dst][out_off[d, i]:out_off[d, i] + len(chunk)] = chunk
  return results


def _inputs(size, per, seed):
  rng = np.random.RandomState(100 + seed)
  operand = jnp.asarray(rng.randn(size * N, W), jnp.float32)
  output = jnp.asarray(rng.randn(size * M, W), jnp.float32)
  tables = tuple(jnp.asarray(t.reshape(-1)) for t in _plan(size, per, seed))
  return operand, output, tables


def _ours(operand, output, io, ss, oo, rs):
  return jo.ragged_all_to_all_start(operand, output, io, ss, oo, rs,
                                    axis_name="i").done()


def _smap(mesh, body):
  return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))


@pytest.mark.parametrize("size, per", [(2, 1), (4, 2)])
def test_values_equal_the_documented_loop(size, per):
  operand, output, tables = _inputs(size, per, seed=size)
  got = np.asarray(jax.jit(_smap(_mesh(size), _ours))(operand, output, *tables))
  split = lambda a, n: np.split(np.asarray(a), size)
  want = _numpy_reference(split(operand, N), split(output, M),
                          *(np.asarray(t).reshape(size, -1) for t in tables))
  np.testing.assert_array_equal(got, np.concatenate(want))
  # The dense jax reference the other tests use agrees with the loop too.
  ref = jax.jit(_smap(_mesh(size), lambda a, b, io, ss, oo, rs:
                      dense_reference(a, b, io, ss, oo, "i")))
  np.testing.assert_array_equal(np.asarray(ref(operand, output, *tables)), got)


def _loss(start_done, ordered):
  def body(operand, output, io, ss, oo, rs):
    def step(operand, output):
      fut = start_done(operand, output, io, ss, oo, rs)
      side = jnp.sin(operand)     # may run while the exchange is in flight
      return fut.done(), side
    if ordered:
      step = jo.program_order(enforce=True)(step)
    y, side = step(operand, output)
    return jnp.cos(y) * y, side
  return body


class _Ready:
  def __init__(self, v):
    self.v = v

  def done(self):
    return self.v


def _start(a, b, io, ss, oo, rs):
  return jo.ragged_all_to_all_start(a, b, io, ss, oo, rs, axis_name="i")


def _reference_start(a, b, io, ss, oo, rs):
  return _Ready(dense_reference(a, b, io, ss, oo, "i"))


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_values_and_gradients_equal_the_reference(jit, ordered):
  size, per = (4, 1) if jit else (2, 1)
  mesh = _mesh(size)
  operand, output, tables = _inputs(size, per, seed=7)

  def run(start, jit):
    f = jax.shard_map(_loss(start, ordered), mesh=mesh, in_specs=P("i"),
                      out_specs=(P("i"), P("i")))
    loss = lambda a, b: sum(jnp.sum(v ** 2) for v in f(a, b, *tables))
    wrap = jax.jit if jit else (lambda g: g)
    return (wrap(f)(operand, output, *tables),
            wrap(jax.grad(loss, argnums=(0, 1)))(operand, output))

  # (The reference runs jitted: eagerly, op by op, it is slow.)
  got, want = run(_start, jit), run(_reference_start, True)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-6)
  # The unwritten output rows pass their gradient through; the written ones
  # get none from the output.
  assert np.any(np.asarray(got[1][1]) == 0) and np.any(np.asarray(got[1][1]))


def test_vmap_inside_shard_map_and_jvp():
  size, per = 2, 2
  mesh = _mesh(size)
  operand, output, tables = _inputs(size, per, seed=3)
  b_op = jnp.stack([operand, 2 * operand], 1)    # batch dim 1, per device
  b_out = jnp.stack([output, -output], 1)

  def run(start):
    def body(a, b, *ints):
      one = lambda a, b: start(a, b, *ints).done()
      return jax.vmap(one, in_axes=1, out_axes=1)(a, b)
    f = jax.jit(_smap(mesh, body))
    jvp = jax.jit(lambda a, b, ta, tb: jax.jvp(
        lambda a, b: f(a, b, *tables), (a, b), (ta, tb)))
    return f(b_op, b_out, *tables), jvp(b_op, b_out, jnp.cos(b_op), b_out)

  got, want = run(_start), run(_reference_start)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_lowers_to_the_dense_form_on_cpu():
  size, per = 2, 1
  operand, output, tables = _inputs(size, per, seed=1)
  text = jax.jit(_smap(_mesh(size), _ours)).lower(
      operand, output, *tables).as_text()
  assert "ragged_all_to_all" not in text
  assert text.count("stablehlo.all_to_all") == 2   # the chunks, the offsets


def test_done_twice_and_never_finished_name_the_future():
  operand, output, tables = _inputs(2, 1, seed=1)

  def twice(*args):
    fut = _start(*args)
    fut.done()
    return fut.done()

  def dropped(*args):
    _start(*args)
    return args[1]

  with pytest.raises(RuntimeError, match=r"done\(\) was called twice on the "
                     r"future from ragged_all_to_all_start started at "):
    jax.jit(_smap(_mesh(2), twice))(operand, output, *tables)
  with pytest.raises(jo.FutureNotFinishedError,
                     match=r"ragged_all_to_all_start started at .*"
                     r"ragged_all_to_all_test.*never finished"):
    jax.jit(_smap(_mesh(2), dropped))(operand, output, *tables)


def test_the_written_schedule_counts_it():
  operand, output, tables = _inputs(2, 1, seed=1)
  report = jo.overlap_report(_smap(_mesh(2), _ours), schedule="written")(
      operand, output, *tables)
  assert "1 collective in the written schedule" in str(report), str(report)
  assert "ragged-all-to-all ragged_all_to_all_start" in str(report)
