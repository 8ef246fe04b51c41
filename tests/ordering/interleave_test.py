"""`interleaved`: two named parts of a function zipped at their futures
(ordering/interleave.py).

What holds: the zipped program is one ordered block in which each part's
future has a matmul of the other part in its window and no two parts'
futures are in flight at once; values and gradients are the function's; a
function whose parts lack futures, or whose parts read each other, runs as
written (or in an order its data allows). The real compilers' windows:
tests/aot/dualpipev_moe_compiled_test.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap._src.ordering.interleave import interleaved
from jax_overlap._src.ordering.primitive import program_order_p

N = 2
PERM = [(i, (i + 1) % N) for i in range(N)]


def _mesh():
  return jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:N])


def _part(x, w, sends: int):
  """`sends` rounds of a matmul then a send of its result (a future)."""
  for _ in range(sends):
    x = jnp.tanh(x @ w)
    x = jax_overlap.ppermute_start(x, "x", PERM).done() @ w
  return x


def _two_parts(x, y, w, *, sends=(2, 2), b_reads_a=False, remat=False):
  """With `remat`, part b runs inside `jax.checkpoint` (a backward under a
  recompute policy does): the zip sees into it."""
  part_b = lambda y_: _part(y_, w, sends[1])
  with jax.named_scope("part_a"):
    a = _part(x, w, sends[0])
  with jax.named_scope("part_b"):
    b = (jax.checkpoint(part_b) if remat else part_b)(
        y + (a if b_reads_a else 0.0))
  return a * 2.0 + b


def _run(fn, zipped=True):
  body = interleaved(fn, ("part_a", "part_b")) if zipped else fn
  return jax.shard_map(body, mesh=_mesh(), in_specs=(P("x"), P("x"), P()),
                       out_specs=P("x"))


def _data():
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (N * 4, 8))
  y = jax.random.normal(k[1], (N * 4, 8))
  w = jax.random.normal(k[2], (8, 8)) / 3
  return x, y, w


def _events(fn):
  """The zipped block's steps: ("start"/"done", part) and ("matmul", part)
  for each matmul of a free block, in order."""
  jaxpr = jax.make_jaxpr(_run(fn))(*_data())
  blocks = [e for e in _walk(jaxpr.eqns) if e.primitive is program_order_p
            and e.params["enforce"]]
  assert len(blocks) == 1, "one ordered block: the zip"
  out = []
  for eqn in _body(blocks[0]).eqns:
    name = eqn.primitive.name
    if name in ("collective_start", "collective_done"):
      out.append((name.split("_")[1], _label(eqn)))
    elif eqn.primitive is program_order_p:
      out += [("matmul", _label(e)) for e in _walk(_body(eqn).eqns)
              if e.primitive.name == "dot_general"]
  return out


def _walk(eqns):
  for e in eqns:
    yield e
    for p in e.params.values():
      inner = getattr(p, "eqns", None) or getattr(getattr(p, "jaxpr", None), "eqns", None)
      if inner:
        yield from _walk(inner)


def _body(eqn):
  body = eqn.params["call_jaxpr"]
  return getattr(body, "jaxpr", body)


def _label(eqn):
  stack = str(eqn.source_info.name_stack)
  return "a" if "part_a" in stack else "b" if "part_b" in stack else None


@pytest.mark.parametrize("sends,remat", [((2, 2), False), ((3, 1), False),
                                         ((1, 3), False), ((2, 2), True)])
def test_each_window_holds_the_other_parts_matmul(sends, remat):
  events = _events(lambda x, y, w: _two_parts(x, y, w, sends=sends,
                                               remat=remat))
  starts = [k for k, (what, _) in enumerate(events) if what == "start"]
  assert len(starts) == sum(sends)
  flying = []
  for k, (what, part) in enumerate(events):
    if what == "start":
      assert not [p for p in flying if p != part], (
          "two parts' futures in flight at once", events)
      flying.append(part)
    elif what == "done":
      flying.remove(part)
  # each window: a matmul of the other part between a start and its done
  # (with unequal parts the longer one's last windows find the other done)
  filled = 0
  for k in starts:
    part = events[k][1]
    end = next(j for j in range(k + 1, len(events))
               if events[j] == ("done", part))
    filled += any(e == ("matmul", "b" if part == "a" else "a")
                  for e in events[k + 1:end])
  assert filled >= 2 * min(sends), (filled, events)
  if sends == (2, 2):
    assert filled == 4, events


@pytest.mark.parametrize("b_reads_a", [False, True])
def test_values_and_gradients_are_the_functions(b_reads_a):
  fn = lambda x, y, w: _two_parts(x, y, w, b_reads_a=b_reads_a)
  x, y, w = _data()
  loss = lambda zipped: lambda *a: jnp.sum(_run(fn, zipped)(*a) ** 2)
  want = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1, 2)))(x, y, w)
  got = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1, 2)))(x, y, w)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_parts_without_futures_run_as_written():
  def fn(x, y, w):
    with jax.named_scope("part_a"):
      a = jnp.tanh(x @ w)
    with jax.named_scope("part_b"):
      b = _part(y, w, 1)
    return a + b
  jaxpr = jax.make_jaxpr(_run(fn))(*_data())
  assert not [e for e in _walk(jaxpr.eqns) if e.primitive is program_order_p]
  np.testing.assert_allclose(jax.jit(_run(fn))(*_data()),
                             jax.jit(_run(fn, zipped=False))(*_data()),
                             rtol=1e-6)
