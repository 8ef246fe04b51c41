"""Every public function in every mode users call it in: one matrix.

Rows are the public APIs (the six `*_start` collectives, psum_start also with
`to="varying"`, the broadcast future `pvary_start`, and `program_order`
around them); columns are the calling modes (eager shard_map, jit, each
autodiff entry point with and without jit, vmap inside and around shard_map,
checkpoint, scan and fori_loop bodies, nested shard_maps, explicit-sharding
meshes, ordered and free blocks, eagerly and jitted). Each cell runs the same
per-device body twice, once with our future and once with the synchronous
`jax.lax` collective, and asserts equal values and gradients (the synchronous
reference of a plain-jax body runs jitted, once for a mode's eager and jit
cells: `_sync_result`). Our warnings
are errors here, so a false "never finished" alarm fails the cell.

The misuse matrix below checks that misuse is still caught in every mode
where it can be: `done()` twice everywhere, a dropped future (an error where
the program is lowered, a warning where it ran eagerly), and a future
returned from a jit.
"""

from __future__ import annotations

import functools
import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src import _compat
from jax_overlap import FutureNotFinishedError, FutureNotFinishedWarning

from ragged_reference import dense_reference

# Eager cells compile each op alone, the same small programs again and again:
# shared through jax's persistent cache (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("shared_compiles")

PERM = [(0, 1), (1, 0)]
HAS_AXIS_TYPES = hasattr(jax.sharding, "AxisType")

# name -> (our future, the synchronous collective, in_spec, out_spec), all over
# mesh axis "i" of size 2. Each body maps a (4, 4) block per device.
APIS = {
    "all_gather": (lambda v: jo.all_gather_start(v, "i", tiled=True),
                   lambda v: lax.all_gather(v, "i", tiled=True), P("i"), P("i")),
    "psum": (lambda v: jo.psum_start(v, "i"), lambda v: lax.psum(v, "i"),
             P("i"), P()),
    # typed varying over "i": its gradient's sum a future too
    "psum_varying": (lambda v: jo.psum_start(v, "i", to="varying"),
                     lambda v: _varying_psum(v), P("i"), P("i")),
    # the broadcast future: a replicated value cast to vary over "i", its
    # gradient's sum a future
    "pvary": (lambda v: jo.pvary_start(v, "i"), lambda v: _varying(v), P(), P("i")),
    "psum_scatter": (lambda v: jo.psum_scatter_start(v, "i", tiled=True),
                     lambda v: lax.psum_scatter(v, "i", tiled=True),
                     P("i"), P("i")),
    "all_to_all": (lambda v: jo.all_to_all_start(v, "i", 0, 1, tiled=True),
                   lambda v: lax.all_to_all(v, "i", 0, 1, tiled=True),
                   P("i"), P("i")),
    "ppermute": (lambda v: jo.ppermute_start(v, "i", PERM),
                 lambda v: lax.ppermute(v, "i", PERM), P("i"), P("i")),
    # XLA:CPU cannot run lax.ragged_all_to_all: the reference is by hand.
    "ragged_all_to_all": (
        lambda v: jo.ragged_all_to_all_start(
            v, _ragged_output(v), *_ragged_tables(), axis_name="i"),
        lambda v: _ragged_reference(v, _ragged_output(v),
                                    *_ragged_tables()[:3]),
        P("i"), P("i")),
}


def _varying_psum(v):
  """`lax.psum` cast back to vary over "i" where this trace types values by
  the mesh axes they vary over (a vmap axis or check_vma=False: no cast)."""
  y = lax.psum(v, "i")
  have = _compat.varying_axes(y)
  mesh_axes = jax.sharding.get_abstract_mesh().axis_names
  if have is None or "i" in have or "i" not in mesh_axes:
    return y
  return lax.pcast(y, "i", to="varying")


def _varying(v):
  """`v` cast to vary over "i" where this trace types values so (a vmap
  axis or check_vma=False: `v` itself)."""
  have = _compat.varying_axes(v)
  mesh_axes = jax.sharding.get_abstract_mesh().axis_names
  if have is None or "i" in have or "i" not in mesh_axes:
    return v
  return lax.pcast(v, "i", to="varying")


# Device 0 sends row 0 to itself and rows 1-2 to device 1; device 1 sends
# rows 2-3 to device 0 and row 0 to itself. Row 2 of device 0's output and
# row 3 of device 1's are written by no one.
_RAGGED_TABLES = ([[0, 1], [2, 0]], [[1, 2], [2, 1]], [[3, 1], [0, 0]],
                  [[1, 2], [2, 1]])


def _ragged_tables():
  d = lax.axis_index("i")
  return tuple(jnp.asarray(t, jnp.int32)[d] for t in _RAGGED_TABLES)


def _ragged_output(v):
  return v[::-1] * 0.5 + 1.0


_ragged_reference = jax.jit(functools.partial(dense_reference, axis="i"))


def _mesh(shape=(2,), names=("i",), explicit=False):
  if not HAS_AXIS_TYPES:
    return jax.make_mesh(shape, names)
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


MESH = _mesh()


def _smap(f, in_specs, out_specs, mesh=MESH, **kwargs):
  """shard_map of a body that returns (result, side): side is split like x."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs,
                       out_specs=(out_specs, in_specs), **kwargs)


def _x(shape=(8, 4), shift=0.0):
  return jnp.arange(float(np.prod(shape))).reshape(shape) / 11.0 + 0.1 + shift


def _body(kind, api, *, ordered=None):
  """The per-device function: collective, then some compute on its result.

  kind "ours" uses the future, "sync" the jax.lax collective. With ordered
  "inside", start/compute/done sit in a program_order(enforce=True) block;
  with "crossing", the start is in a free block and done() in its ordered
  parent, so the future crosses a block boundary.
  """
  start, sync, _, _ = APIS[api]
  begin = start if kind == "ours" else (lambda v: _Ready(sync(v)))

  def plain(v):
    fut = begin(v)
    side = jnp.sin(v)   # may run while the collective is in flight
    y = fut.done()
    return y * jnp.cos(y), side

  if ordered is None:
    return plain
  if ordered == "inside":
    return jo.program_order(enforce=True)(plain)

  @jo.program_order(enforce=True)
  def crossing(v):
    fetch = jo.program_order(enforce=False)(begin)
    fut = fetch(v)
    side = jnp.sin(v)
    y = fut.done()
    return y * jnp.cos(y), side
  return crossing


class _Ready:
  """A finished value that looks like a future (the sync reference)."""

  def __init__(self, value):
    self.value = value

  def done(self):
    return self.value


jax.tree_util.register_pytree_node(_Ready, lambda r: ((r.value,), None),
                                   lambda _, c: _Ready(c[0]))


def _loss(f):
  return lambda x: sum(jnp.sum(y ** 2) for y in jax.tree.leaves(f(x)))


def _maybe_jit(fn, jit):
  return jax.jit(fn) if jit else fn


# --- the modes: each maps (body, in_spec, out_spec) to a pytree of arrays -----

def _plain(jit):
  def run(body, si, so):
    return _maybe_jit(_smap(body, si, so), jit)(_x())
  return run


def _grad(jit):
  def run(body, si, so):
    return _maybe_jit(jax.grad(_loss(_smap(body, si, so))), jit)(_x())
  return run


def _jvp(jit):
  def run(body, si, so):
    f = _smap(body, si, so)
    return _maybe_jit(lambda x, t: jax.jvp(f, (x,), (t,)), jit)(_x(), _x(shift=1.0))
  return run


def _vjp(jit):
  def run(body, si, so):
    def go(x):
      y, pull = jax.vjp(_smap(body, si, so), x)
      return y, pull(jax.tree.map(jnp.cos, y))
    return _maybe_jit(go, jit)(_x())
  return run


def _linearize(jit):
  def run(body, si, so):
    def go(x, t):
      y, lin = jax.linearize(_smap(body, si, so), x)
      return y, lin(t)
    return _maybe_jit(go, jit)(_x(), _x(shift=1.0))
  return run


def _vmap_inside(jit):
  # The body maps one (4, 4) slice of a (4, 3, 4) block, batched over axis 1.
  def run(body, si, so):
    inner = jax.vmap(body, in_axes=1, out_axes=1)
    f = _smap(inner, si, so)
    x = _x((8, 3, 4))
    return _maybe_jit(f, jit)(x), _maybe_jit(jax.grad(_loss(f)), jit)(x)
  return run


def _vmap_around(jit):
  def run(body, si, so):
    f = jax.vmap(_smap(body, si, so))
    x = jnp.stack([_x(), _x(shift=2.0), _x(shift=-1.0)])
    return _maybe_jit(f, jit)(x), _maybe_jit(jax.grad(_loss(f)), jit)(x)
  return run


def _checkpoint(jit):
  def run(body, si, so):
    f = _smap(jax.checkpoint(body), si, so)
    return _maybe_jit(f, jit)(_x()), _maybe_jit(jax.grad(_loss(f)), jit)(_x())
  return run


def _scan(jit):
  def run(body, si, so):
    def per_device(v):
      def step(carry, k):
        return carry + 1.0, body(v * carry + k)
      return lax.scan(step, 1.0, jnp.arange(3.0))[1]
    f = jax.shard_map(per_device, mesh=MESH, in_specs=si,
                      out_specs=(P(None, *so), P(None, *si)))
    return _maybe_jit(f, jit)(_x()), _maybe_jit(jax.grad(_loss(f)), jit)(_x())
  return run


def _fori(jit):
  def run(body, si, so):
    def per_device(v):
      add = lambda a, b: jax.tree.map(jnp.add, a, b)
      return lax.fori_loop(1, 3, lambda k, acc: add(acc, body(v * (k + 1.0))),
                           body(v))
    f = _smap(per_device, si, so)
    return _maybe_jit(f, jit)(_x()), _maybe_jit(jax.grad(_loss(f)), jit)(_x())
  return run


NESTED_MESH = _mesh((2, 2), ("o", "i"))


def _nested(jit):
  # An outer shard_map over "o" holds an inner one over "i". Values and jvp:
  # reverse mode of nested shard_maps fails in jax itself (0.10.2 to 0.12,
  # with its own lax.psum too: "duplicate entries for `o`" eagerly, a
  # verifier error under jit), so there is nothing to compare with.
  def run(body, si, so):
    inner = jax.shard_map(body, in_specs=si, out_specs=(so, si),
                          axis_names={"i"})
    outer = jax.shard_map(inner, mesh=NESTED_MESH, in_specs=P("o"),
                          out_specs=(P("o"), P("o")), axis_names={"o"})
    x, t = _x((16, 4)), _x((16, 4), shift=1.0)
    return _maybe_jit(lambda x, t: jax.jvp(outer, (x,), (t,)), jit)(x, t)
  return run


EXPLICIT_MESH = _mesh(explicit=True) if HAS_AXIS_TYPES else None


def _explicit(jit):
  def run(body, si, so):
    f = _smap(body, si, so, mesh=EXPLICIT_MESH)
    x = jax.device_put(_x(), NamedSharding(EXPLICIT_MESH, si))   # as the body takes it
    with jax.sharding.use_mesh(EXPLICIT_MESH) if hasattr(jax.sharding, "use_mesh") \
        else jax.set_mesh(EXPLICIT_MESH):
      return _maybe_jit(f, jit)(x), _maybe_jit(jax.grad(_loss(f)), jit)(x)
  return run


def _ordered(where, jit):
  # Marker: the body is built with `ordered=where`, then run plainly with grad.
  def run(body, si, so):
    f = _smap(body, si, so)
    return _maybe_jit(f, jit)(_x()), _maybe_jit(jax.grad(_loss(f)), jit)(_x())
  run.ordered = where
  return run


MODES = {}
for _jit, _tag in ((False, "eager"), (True, "jit")):
  MODES.update({
      f"shard_map[{_tag}]": _plain(_jit),
      f"grad[{_tag}]": _grad(_jit),
      f"jvp[{_tag}]": _jvp(_jit),
      f"vjp[{_tag}]": _vjp(_jit),
      f"linearize[{_tag}]": _linearize(_jit),
      f"vmap_inside_shard_map[{_tag}]": _vmap_inside(_jit),
      f"vmap_around_shard_map[{_tag}]": _vmap_around(_jit),
      f"checkpoint[{_tag}]": _checkpoint(_jit),
      f"scan_body[{_tag}]": _scan(_jit),
      f"fori_loop_body[{_tag}]": _fori(_jit),
      f"nested_shard_map[{_tag}]": _nested(_jit),
      f"explicit_mesh[{_tag}]": _explicit(_jit),
      f"ordered_block[{_tag}]": _ordered("inside", _jit),
      f"future_crosses_free_block[{_tag}]": _ordered("crossing", _jit),
  })



def _close(got, want, exact):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    if exact:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)


# The ragged all-to-all's CPU form and its reference are some 30 ops each, and
# an eager shard_map dispatches them one at a time (10-45 s a cell here): its
# eager column keeps the plain call and grad; every jit column runs.
RAGGED_EAGER = ("shard_map[eager]", "grad[eager]")
CELLS = [(api, mode) for api in sorted(APIS) for mode in sorted(MODES)
         if not (api == "ragged_all_to_all" and mode.endswith("[eager]")
                 and mode not in RAGGED_EAGER)]


_SYNC_RESULTS = {}


def _sync_result(api, mode):
  """The synchronous body's result in `mode`. Where the body is plain jax (no
  program_order around it) its eager run tests jax, not this library, so an
  eager cell takes the jitted mode's result, computed once for both cells
  (eager dispatch would compile every op of the reference again). Plain
  values stay eager against eager: they are compared bit for bit."""
  run = MODES[mode]
  _, _, si, so = APIS[api]
  ordered = getattr(run, "ordered", None)
  if ordered is not None or mode.startswith("shard_map"):
    return run(_body("sync", api, ordered=ordered), si, so)
  jitted = mode.replace("[eager]", "[jit]")
  if (api, jitted) not in _SYNC_RESULTS:
    _SYNC_RESULTS[api, jitted] = MODES[jitted](_body("sync", api), si, so)
  return _SYNC_RESULTS[api, jitted]


@pytest.mark.parametrize("api, mode", CELLS,
                         ids=[f"{a}-{m}" for a, m in CELLS])
def test_mode_matrix(api, mode):
  if mode.startswith("explicit_mesh") and EXPLICIT_MESH is None:
    pytest.skip("this jax has no jax.sharding.AxisType (Explicit meshes)")
  run = MODES[mode]
  _, _, si, so = APIS[api]
  ordered = getattr(run, "ordered", None)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FutureNotFinishedWarning)
    got = run(_body("ours", api, ordered=ordered), si, so)
    want = _sync_result(api, mode)
    gc.collect()  # a falsely watched future would warn (= fail) here
  # The same ops run in both, so plain values are bit for bit; derivatives
  # may sum in another order.
  _close(got, want, exact=mode.startswith("shard_map"))


# --- misuse, in every mode where it can be caught --------------------------------

def _done_twice(v):
  fut = jo.psum_start(v, "i")
  fut.done()
  return fut.done(), v


def _dropped(v):
  jo.all_gather_start(v, "i", tiled=True)
  return v, v


MISUSE_MODES = {
    "shard_map[eager]": lambda f, so: _smap(f, P("i"), so)(_x()),
    "shard_map[jit]": lambda f, so: jax.jit(_smap(f, P("i"), so))(_x()),
    "grad[eager]": lambda f, so: jax.grad(_loss(_smap(f, P("i"), so)))(_x()),
    "grad[jit]": lambda f, so: jax.jit(jax.grad(_loss(_smap(f, P("i"), so))))(_x()),
    "vmap_around_shard_map[jit]": lambda f, so: jax.jit(jax.vmap(
        _smap(f, P("i"), so)))(jnp.stack([_x(), _x()])),
    "ordered_block[eager]": lambda f, so: _smap(
        jo.program_order(enforce=True)(f), P("i"), so)(_x()),
    "ordered_block[jit]": lambda f, so: jax.jit(_smap(
        jo.program_order(enforce=True)(f), P("i"), so))(_x()),
    "scan_body[jit]": lambda f, so: jax.jit(jax.shard_map(
        lambda v: lax.scan(lambda c, _: (c, f(v)), 0.0, None, length=2)[1],
        mesh=MESH, in_specs=P("i"), out_specs=(P(None, *so), P(None, "i"))))(_x()),
}


@pytest.mark.parametrize("mode", sorted(MISUSE_MODES))
def test_done_twice_is_caught_in_every_mode(mode):
  with pytest.raises(RuntimeError, match=r"done\(\) was called twice on the "
                     r"future from psum_start started at .*modes_test"):
    MISUSE_MODES[mode](_done_twice, P())


@pytest.mark.parametrize("mode", sorted(MISUSE_MODES))
def test_dropped_future_is_caught_in_every_mode(mode):
  message = r"all_gather_start started at .*modes_test.*never finished"
  if mode == "shard_map[eager]":
    # Nothing is lowered as a whole: the future ran at once, and is reported
    # when it is collected. (An eager ordered block drops dead code first,
    # as its lowering would, and finds it there.)
    with pytest.warns(FutureNotFinishedWarning, match=message):
      MISUSE_MODES[mode](_dropped, P("i"))
      gc.collect()
  else:
    with pytest.raises(FutureNotFinishedError, match=message):
      MISUSE_MODES[mode](_dropped, P("i"))
  if mode == "grad[eager]":
    # The primal ran eagerly too, so that future is watched as well (a jax
    # cache keyed on the collective's params keeps it alive until cleared).
    # The error above reported it: collected, it must not warn again.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", FutureNotFinishedWarning)
      jax.clear_caches()
      gc.collect()
    assert not [w for w in caught
                if issubclass(w.category, FutureNotFinishedWarning)], [
                    str(w.message) for w in caught]


def test_future_returned_from_jit_is_caught():
  f = _smap(lambda v: (jo.ppermute_start(v, "i", PERM), v), P("i"), P("i"))
  with pytest.raises(FutureNotFinishedError, match=r"returned from the jit"):
    jax.jit(f)(_x())


def test_future_returned_from_eager_shard_map_is_ready():
  # Eagerly, the collective already ran; the future that leaves the
  # shard_map holds its value, and done() outside hands it over.
  fut, _ = _smap(lambda v: (jo.ppermute_start(v, "i", PERM), v), P("i"),
                 P("i"))(_x())
  want, _ = jax.jit(_smap(lambda v: (lax.ppermute(v, "i", PERM), v), P("i"),
                          P("i")))(_x())
  with warnings.catch_warnings():
    warnings.simplefilter("error", FutureNotFinishedWarning)
    np.testing.assert_array_equal(np.asarray(fut.done()), np.asarray(want))
    del fut
    gc.collect()
