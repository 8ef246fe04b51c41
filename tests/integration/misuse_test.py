"""Every misuse in docs/misuse.md, one test a row: the error, its message.

Each row is (id, what the user did, the call, the exception, a pattern its
message matches). docs/misuse.md lists the same ids with the messages; a test
checks the two agree. Errors found where the program is lowered (a future
never finished) name the user's line in the message; the others are raised
at the user's call.
"""

from __future__ import annotations

import functools
import gc
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "misuse.md"
HAS_EXPLICIT = hasattr(jax.sharding, "AxisType") and hasattr(jax, "reshard")
MESH = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
X = jnp.arange(32.0).reshape(8, 4) / 7
HERE = r"misuse_test\.py:\d+"


def smap(f, in_specs=P("i"), out_specs=P("i")):
  return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs,
                               out_specs=out_specs))


def body(x):
  return jnp.sin(x)


def _done_twice():
  def f(v):
    fut = jo.psum_start(v, "i")
    fut.done()
    return fut.done()
  return smap(f, out_specs=P())(X)


def _scan_carry():
  def f(v):
    step = lambda fut, _: (jo.psum_start(fut.done() + 1, "i"), None)
    return lax.scan(step, jo.psum_start(v, "i"), None, length=2)[0].done()
  return smap(f, out_specs=P())(X)


def _fori_carry():
  def f(v):
    step = lambda k, fut: jo.psum_start(fut.done(), "i")
    return lax.fori_loop(0, 2, step, jo.psum_start(v, "i")).done()
  return smap(f, out_specs=P())(X)


def _while_carry():
  def f(v):
    return lax.while_loop(lambda fut: False, lambda fut: fut,
                          jo.psum_start(v, "i")).done()
  return smap(f, out_specs=P())(X)


def _cond_branches():
  def f(v):
    fut = lax.cond(True, lambda v: jo.psum_start(v, "i"),
                   lambda v: jo.psum_start(2 * v, "i"), v)
    return fut.done()
  return smap(f, out_specs=P())(X)


RAGGED_INTS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def _ragged(**override):
  """A ragged_all_to_all_start with one argument replaced."""
  def f(v):
    args = dict(operand=v, output=jnp.zeros_like(v),
                **{k: jnp.zeros(2, jnp.int32) for k in RAGGED_INTS})
    args.update(override)
    return jo.ragged_all_to_all_start(**args, axis_name="i").done()
  return smap(f)(X)


def _static_argument():
  f = jo.program_order(lambda x, n: jnp.ones((n,)) * x.sum(), enforce=True)
  return f(X, 3)


def _explicit_mesh_shard_dims():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  w = jax.device_put(jnp.ones((2, 8, 8)), NamedSharding(mesh, P(None, "d")))
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("d")))
  ctx = (jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh")
         else jax.set_mesh(mesh))
  with ctx:
    return jax.jit(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="d",
                                             shard_dims=1))(x, w)


def _fsdp_on(mesh_kind, shape, names, w_spec, axis, x_spec=None):
  mesh = jax.make_mesh(shape, names, axis_types=(mesh_kind,) * len(names))
  w = jax.device_put(jnp.ones((2, 8, 8)), NamedSharding(mesh, w_spec))
  x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, x_spec or P(names[0])))
  with jax.set_mesh(mesh):
    return jax.jit(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w,
                                             axis=axis))(x, w)


def _fsdp_auto_mesh():
  return _fsdp_on(jax.sharding.AxisType.Auto, (8,), ("d",), P(None, "d"), "d")


def _fsdp_layer_dim_sharded():
  return _fsdp_on(jax.sharding.AxisType.Explicit, (2, 4), ("l", "d"),
                  P("l", "d"), "d", x_spec=P("d"))


def _moe(fn=None, x=None, ids=None, w=None, params=None, params_spec=P("i"),
         **kwargs):
  """expert_parallel over MESH (2 devices, one expert each), 4 tokens of
  width 4 a device, k = 1; each keyword changes one argument."""
  kwargs.setdefault("axis", "i")
  fn = (lambda p, t: t @ p) if fn is None else fn
  same = lambda a: a
  x, ids, w, params = (f or same for f in (x, ids, w, params))
  def local(xs, p):
    i = np.zeros((4, 1), np.int32)    # concrete ids, in range unless changed
    return jo.expert_parallel(fn, x(xs), ids(i), w(jnp.ones((4, 1))),
                              params(p), **kwargs)
  return smap(local, in_specs=(P("i"), params_spec), out_specs=P("i"))(
      X, jnp.ones((2, 4, 4)))


def _pipeline(stage_fn=None, loss_fn=None, w=None, xs=None, ts=None, order=0,
              xs_spec=P(), **kwargs):
  """pipeline_loss over MESH (2 stages of a 4x4 matmul), 4 microbatches of
  shape (2, 4), traced (not run); order=2 takes a second derivative."""
  stage = (lambda w, x: x @ w) if stage_fn is None else stage_fn
  loss = (lambda y, t: jnp.mean((y - t) ** 2)) if loss_fn is None else loss_fn
  w = jnp.stack([jnp.eye(4), 2 * jnp.eye(4)]) if w is None else w
  xs = jnp.ones((4, 2, 4)) if xs is None else xs
  ts = jnp.zeros((4, 2, 4)) if ts is None else ts
  f = jax.shard_map(
      lambda w, x, t: jo.pipeline_loss(stage, loss, w, x, t, axis="i", **kwargs),
      mesh=MESH, in_specs=(P("i"), xs_spec, P()), out_specs=P())
  if order == 2:
    g = jax.grad(lambda x: f(w, x, ts))
    return jax.eval_shape(jax.grad(lambda x: g(x).sum()), xs)
  return jax.eval_shape(f, w, xs, ts)


def _attention(fn, q=(1, 8, 8, 8), k=(1, 8, 2, 8), v=None, **kwargs):
  """ring_attention or ulysses_attention over MESH (sequence sharded over
  'i'), traced; q, k, v given as global shapes (batch, seq, heads, head_dim)."""
  kwargs.setdefault("axis", "i")
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (q, k, k if v is None else v)]
  f = jax.shard_map(lambda q, k, v: fn(q, k, v, **kwargs), mesh=MESH,
                    in_specs=P(None, "i"), out_specs=P(None, "i"))
  return jax.eval_shape(f, *args)


FUTURE_CARRY = r"a future cannot be a lax\.scan/fori_loop/while_loop carry"
MISUSES = [
    # --- program_order ---------------------------------------------------------
    ("enforce-missing", "program_order without enforce",
     lambda: jo.program_order(body), TypeError,
     r"requires the keyword argument `enforce`"),
    ("enforce-not-bool", "enforce=None",
     lambda: jo.program_order(enforce=None), TypeError,
     r"enforce=\.\.\.\) must be True or False, got None"),
    ("not-callable", "decorating something that is not a function",
     lambda: jo.program_order(enforce=True)(42), TypeError,
     r"program_order expects a function, got 42"),
    ("exclude-on-ordered", "exclude_argnames with enforce=True",
     lambda: jo.program_order(enforce=True, exclude_argnames="x"), ValueError,
     r"exclude_argnames cannot be used with enforce=True"),
    ("exclude-unknown-name", "exclude_argnames naming no parameter",
     lambda: jo.program_order(body, enforce=False, exclude_argnames="w"),
     ValueError, r"names \['w'\] but body has no such parameter"),
    ("exclude-not-names", "exclude_argnames=3",
     lambda: jo.program_order(enforce=False, exclude_argnames=3), TypeError,
     r"must be a parameter name or a sequence of names, got 3"),
    ("strict-on-free", "strict_in_out on a free block",
     lambda: jo.program_order(enforce=False, strict_in_out=True), ValueError,
     r"strict_in_out=True cannot be used with enforce=False"),
    ("strict-not-pair", "strict_in_out=(True,)",
     lambda: jo.program_order(enforce=True, strict_in_out=(True,)), TypeError,
     r"must be a bool or a pair of bools"),
    ("static-argument", "a Python int argument used as a shape",
     _static_argument, TypeError, r"Shapes must be 1D sequences of concrete"),
    # --- futures -----------------------------------------------------------------
    ("done-twice", "done() twice on one future",
     _done_twice, RuntimeError,
     rf"done\(\) was called twice on the future from psum_start started at .*{HERE}"),
    ("never-finished", "a future dropped inside jit",
     lambda: smap(lambda v: (jo.all_gather_start(v, "i", tiled=True), v)[1])(X),
     jo.FutureNotFinishedError,
     rf"all_gather_start started at .*{HERE}.* was never finished"),
    ("returned-from-jit", "a future returned from the jit that started it",
     lambda: smap(lambda v: jo.ppermute_start(v, "i", [(0, 1), (1, 0)]))(X),
     jo.FutureNotFinishedError,
     rf"ppermute_start started at .*{HERE}.*returned from the jit"),
    ("used-as-array", "a future passed to jnp.sin",
     lambda: smap(lambda v: jnp.sin(jo.psum_start(v, "i")), out_specs=P())(X),
     TypeError, rf"future from psum_start started at .*{HERE}.* is not an array\. "
     r"Call \.done\(\) on it first"),
    ("arithmetic", "future + 1",
     lambda: smap(lambda v: jo.psum_start(v, "i") + 1, out_specs=P())(X),
     TypeError, r"is not an array\. Call \.done\(\)"),
    ("truth-value", "if future:",
     lambda: smap(lambda v: v if jo.psum_start(v, "i") else v)(X),
     TypeError, r"is not an array\. Call \.done\(\)"),
    ("scan-carry", "a future carried across lax.scan iterations",
     _scan_carry, TypeError, FUTURE_CARRY),
    ("fori-carry", "a future carried across fori_loop iterations",
     _fori_carry, TypeError, FUTURE_CARRY),
    ("while-carry", "a future carried through while_loop",
     _while_carry, TypeError, FUTURE_CARRY),
    ("cond-output", "futures returned from lax.cond branches",
     _cond_branches, TypeError, r"lax\.cond/switch output; call \.done\(\) inside"),
    # --- collectives ---------------------------------------------------------------
    ("unknown-axis", "an axis name shard_map did not bind",
     lambda: smap(lambda v: jo.psum_start(v, "j").done(), out_specs=P())(X),
     NameError, r"unknown axis name 'j'; the axis names in scope here are \['i'\]"),
    ("outside-shard_map", "a collective outside any shard_map",
     lambda: jax.jit(lambda v: jo.psum_start(v, "i").done())(X),
     NameError, r"the axis names in scope here are \[\]\. Call it inside jax\.shard_map"),
    ("axis-of-another-mesh", "an axis of another mesh",
     lambda: smap(lambda v: jo.all_gather_start(v, "model").done())(X),
     NameError, r"unknown axis name 'model'"),
    ("perm-duplicate", "a perm with a destination twice",
     lambda: smap(lambda v: jo.ppermute_start(v, "i", [(0, 1), (1, 1)]).done())(X),
     ValueError, r"is not a permutation: a destination appears twice"),
    ("perm-out-of-range", "a perm index past the axis",
     lambda: smap(lambda v: jo.ppermute_start(v, "i", [(0, 2)]).done())(X),
     ValueError, r"an index is outside 0\.\.1 \(axis 'i' has size 2\)"),
    ("perm-not-pairs", "perm=[1, 0]",
     lambda: smap(lambda v: jo.ppermute_start(v, "i", [1, 0]).done())(X),
     ValueError, r"perm must be a sequence of \(source, destination\) pairs"),
    ("scatter-not-divisible", "psum_scatter over a dimension the axis does not divide",
     lambda: smap(lambda v: jo.psum_scatter_start(v[:3], "i", tiled=True).done())(X),
     ValueError, r"psum_scatter_start: .*divisible"),
    ("all-to-all-not-divisible", "all_to_all split the axis does not divide",
     lambda: smap(lambda v: jo.all_to_all_start(v[:, :3], "i", 1, 0,
                                                tiled=True).done())(X),
     ValueError, r"all_to_all_start: .*divisible"),
    ("gather-axis-out-of-range", "all_gather_start(axis=5) on a 2-d array",
     lambda: smap(lambda v: jo.all_gather_start(v, "i", axis=5).done())(X),
     ValueError, r"all_gather_start: axis 5 is out of bounds"),
    ("not-an-array", "a string as the operand",
     lambda: smap(lambda v: jo.psum_start("abc", "i").done(), out_specs=P())(X),
     TypeError, r"psum_start: Value 'abc' .* is not a valid JAX array type"),
    # --- ragged_all_to_all_start ------------------------------------------------------
    ("ragged-offsets-dtype", "float offsets",
     lambda: _ragged(input_offsets=jnp.zeros(2)),
     TypeError, r"ragged_all_to_all_start\(input_offsets=\.\.\.\): input_offsets "
     r"must be an integer array; got dtype float32"),
    ("ragged-sizes-shape", "send_sizes of shape (2, 1)",
     lambda: _ragged(send_sizes=jnp.ones((2, 1), jnp.int32)),
     ValueError, r"ragged_all_to_all_start\(send_sizes=\.\.\.\): send_sizes must "
     r"be a non-empty 1-D array .* got shape \(2, 1\)"),
    ("ragged-lengths-differ", "recv_sizes of another length than the offsets",
     lambda: _ragged(recv_sizes=jnp.ones(4, jnp.int32)),
     ValueError, r"ragged_all_to_all_start: input_offsets, send_sizes, "
     r"output_offsets and recv_sizes must have one length"),
    ("ragged-chunks-not-divisible", "3 chunks over an axis of 2 devices",
     lambda: _ragged(**{k: jnp.ones(3, jnp.int32) for k in RAGGED_INTS}),
     ValueError, r"ragged_all_to_all_start\(input_offsets=\.\.\.\): the number of "
     r"chunks \(3\) must be a multiple of the number of devices exchanging \(2\)"),
    ("ragged-output-shape", "output rows of another width than operand's",
     lambda: _ragged(output=jnp.zeros((4, 3))),
     ValueError, r"ragged_all_to_all_start\(output=\.\.\.\): output's shape "
     r"\(4, 3\) must be operand's \(4, 4\) but for its first dimension"),
    ("ragged-output-dtype", "output of another dtype than operand",
     lambda: _ragged(output=jnp.zeros((4, 4), jnp.int32)),
     TypeError, r"ragged_all_to_all_start\(output=\.\.\.\): output's dtype int32 "
     r"must be operand's \(float32\)"),
    # --- fsdp_scan -------------------------------------------------------------------
    ("fsdp-layer", "fsdp_scan(layer=42)",
     lambda: jo.fsdp_scan(42, X, {"w": jnp.ones((2, 4, 4))}, axis="i",
                          params_first=True),
     TypeError, r"fsdp_scan\(layer=\.\.\.\) must be a function "
     r"layer\(params\[i\], x\) -> x, got 42"),
    ("fsdp-params-first", "params_first='yes'",
     lambda: jo.fsdp_scan(lambda w, x: x, X, {"w": jnp.ones((2, 4, 4))},
                          axis="i", params_first="yes"),
     TypeError, r"fsdp_scan\(params_first=\.\.\.\) must be True or False, "
     r"got 'yes'"),
    ("fsdp-no-layer-dim", "a parameter with no layer dimension",
     lambda: jo.fsdp_scan(lambda x, w: x, X, {"w": jnp.ones((4,))}, axis="i"),
     ValueError, r"leaf \['w'\] has shape \(4,\); every leaf needs a leading layer"),
    ("fsdp-layers-differ", "parameters stacked over different numbers of layers",
     lambda: jo.fsdp_scan(lambda x, w: x, X, {"a": jnp.ones((2, 4, 4)),
                                               "b": jnp.ones((3, 4, 4))}, axis="i"),
     ValueError, r"the leading \(layer\) dimension differs between leaves"),
    ("fsdp-unsharded", "fsdp_scan outside shard_map, weights not sharded",
     lambda: jax.jit(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i"))(
         X, jnp.ones((2, 4, 4))),
     ValueError, r"is not sharded over a mesh axis 'i'\. Call fsdp_scan inside "
     r"jax\.shard_map"),
    ("fsdp-shard-dims", "shard_dims past the last dimension",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i",
                                            shard_dims=3),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     ValueError, r"shard_dims=\.\.\.\): 3 is not a dimension after the layer"),
    ("fsdp-shard-dims-explicit", "shard_dims on an explicit-sharding mesh",
     _explicit_mesh_shard_dims, ValueError,
     r"shard_dims=\.\.\.\) is for use inside jax\.shard_map"),
    ("fsdp-remat-policy", "remat_policy='nothing' (a name, not a policy)",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i",
                                            remat_policy="nothing"),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     TypeError, r"fsdp_scan\(remat_policy=\.\.\.\) must be a jax\.checkpoint "
     r"policy \(a function\) or None, got 'nothing'\. Pass the policy itself.*"
     r"jax\.checkpoint_policies\.nothing_saveable"),
    ("fsdp-unstacked", "one layer's weights, not stacked over layers",
     lambda: smap(lambda x, w: jo.fsdp_scan(
         lambda w, x: jnp.einsum("bi,io->bo", x, w), x, w, axis="i",
         params_first=True),
         in_specs=(P("i"), P(None, "i")))(X, jnp.ones((4, 4))),
     ValueError, r"fsdp_scan\(layer=\.\.\., params=\.\.\.\): the layer fails on x "
     r"and one layer's weights .*\(4 layers here\) and calls "
     r"layer\(params\[i\], x\) .*params\[i\]: \. float32\[4\].*"
     r"stack them with a leading layer dimension"),
    ("fsdp-layer-output", "a layer whose output dtype differs from its input",
     lambda: smap(lambda x, w: jo.fsdp_scan(
         lambda x, w: (x @ w).astype(jnp.bfloat16), x, w, axis="i"),
         in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     ValueError, r"fsdp_scan\(layer=\.\.\.\) must return the same structure, "
     r"shapes and dtypes as its input x .*'float32\[4,4\].*'bfloat16\[4,4\]"),
    ("fsdp-axis-unknown", "a misspelt axis inside shard_map",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="j"),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     NameError, r"fsdp_scan\(axis='j'\): no mesh axis named 'j' here: the "
     r"enclosing jax\.shard_map binds \('i',\)"),
    ("fsdp-axis-type", "axis=3", lambda: jo.fsdp_scan(
        lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis=3),
     TypeError, r"fsdp_scan\(axis=\.\.\.\) must be a mesh axis name or a tuple"),
    ("fsdp-auto-mesh", "fsdp_scan outside shard_map on an Auto mesh",
     _fsdp_auto_mesh, ValueError,
     r"leaf \(params itself\) is on a mesh whose axis 'd' is AxisType\.Auto .*Make the mesh "
     r"with axis_types=\(jax\.sharding\.AxisType\.Explicit"),
    ("fsdp-layer-dim-sharded", "the layer dimension sharded on an explicit mesh",
     _fsdp_layer_dim_sharded, ValueError,
     r"its layer dimension \(the first\) is sharded over 'l'"),
    ("fsdp-param-dtype", "param_dtype=jnp.int8 (not a floating dtype)",
     lambda: jo.fsdp_scan(lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          param_dtype=jnp.int8),
     TypeError, r"fsdp_scan\(param_dtype=\.\.\.\) must be a floating dtype "
     r"such as jnp\.bfloat16 or jnp\.float32, or None, got <class "
     r"'jax\.numpy\.int8'>"),
    ("fsdp-xs-layers", "xs not stacked over the layers of params",
     lambda: jo.fsdp_scan(lambda x, w, i: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          xs=jnp.arange(3)),
     ValueError, r"fsdp_scan\(xs=\.\.\.\): leaf \(xs itself\) has shape \(3,\); "
     r"every leaf of xs is stacked over the layers like params \(a leading "
     r"dimension of 2"),
    ("fsdp-bucket", "bucket='auto' (not a bool)",
     lambda: jo.fsdp_scan(lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          bucket="auto"),
     TypeError, r"fsdp_scan\(bucket=\.\.\.\) must be True or False, got 'auto'\."),
    ("fsdp-replica-axis", "a misspelt replica_axis inside shard_map",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i",
                                            replica_axis="r"),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     NameError, r"fsdp_scan\(replica_axis='r'\): no mesh axis named 'r' here: "
     r"the enclosing jax\.shard_map binds \('i',\)"),
    ("fsdp-before", "before=42 (not a function)",
     lambda: jo.fsdp_scan(lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          before=42),
     TypeError, r"fsdp_scan\(before=\.\.\.\) must be a function or None, got "
     r"42\. It is called as before\(x\) on fsdp_scan's x"),
    ("fsdp-before-fails", "a before that fails on fsdp_scan's x",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i",
                                            before=lambda t: t @ jnp.ones((3, 4))),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     ValueError, r"fsdp_scan\(before=\.\.\.\) fails on x: \. float32\[4,4\].* "
     r"\(TypeError: dot_general requires contracting dimensions"),
    ("fsdp-after-fails", "an after that fails on the last layer's output",
     lambda: smap(lambda x, w: jo.fsdp_scan(lambda x, w: x @ w, x, w, axis="i",
                                            after=lambda y: y @ jnp.ones((3, 4))),
                  in_specs=(P("i"), P(None, "i")))(X, jnp.ones((2, 4, 4))),
     ValueError, r"fsdp_scan\(after=\.\.\.\) fails on y: \. float32\[4,4\].*"
     r"It is called as after\(y\) on the last layer's output y"),
    ("fsdp-reshard-after-forward", "reshard_after_forward=3 with 2 layers",
     lambda: jo.fsdp_scan(lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          reshard_after_forward=3),
     ValueError, r"fsdp_scan\(reshard_after_forward=\.\.\.\) must be True "
     r"\(regather every layer in the backward pass\), False \(keep every "
     r"gathered layer\) or an int from 0 to the number of layers \(2 here\).*"
     r"got 3\."),
    ("fsdp-prefetch", "prefetch=0",
     lambda: jo.fsdp_scan(lambda x, w: x @ w, X, jnp.ones((2, 4, 4)), axis="i",
                          prefetch=0),
     ValueError, r"fsdp_scan\(prefetch=\.\.\.\) must be an int >= 1, how many "
     r"layers ahead of its use each weight gather starts .*got 0\."),
    # --- collective matmul -------------------------------------------------------------
    ("matmul-axis", "all_gather_matmul over an unbound axis",
     lambda: smap(lambda v: jo.all_gather_matmul(v, jnp.ones((4, 4)), "j"))(X),
     NameError, r"all_gather_matmul\(axis='j'\): no mesh axis named 'j'"),
    ("matmul-gathered-contraction", "gathering the contracted dimension",
     lambda: smap(lambda v: jo.all_gather_matmul(v, jnp.ones((4, 4)), "i",
                                                 gather_dimension=-1))(X),
     ValueError, r"gather_dimension"),
    # --- expert_parallel (MoE) -----------------------------------------------------------
    ("moe-axis", "expert_parallel over an unbound axis",
     lambda: _moe(axis="j"), NameError,
     r"expert_parallel\(axis='j'\): no mesh axis named 'j' is bound here"),
    ("moe-expert-fn", "expert_fn=42 (not a function)",
     lambda: _moe(fn=42), TypeError,
     r"expert_parallel\(expert_fn=\.\.\.\) must be a function "
     r"expert_fn\(expert_params_e, tokens\[C, D\]\) -> \[C, D\], got 42"),
    ("moe-x-shape", "x of shape [T] (not [T, D])",
     lambda: _moe(x=lambda x: x[:, 0]), ValueError,
     r"expert_parallel\(x=\.\.\.\) must be this device's tokens, shape "
     r"\[T, D\], got shape \(4,\)"),
    ("moe-ids-shape", "expert_ids with another T than x",
     lambda: _moe(ids=lambda ids: ids[:3]), ValueError,
     r"expert_parallel\(expert_ids=\.\.\.\) must be \[T, k\].*T = 4 as in x "
     r"\(shape \(4, 4\)\); got shape \(3, 1\)"),
    ("moe-ids-dtype", "expert_ids of floats",
     lambda: _moe(ids=lambda ids: ids.astype(jnp.float32)), TypeError,
     r"expert_parallel\(expert_ids=\.\.\.\) must be integers"),
    ("moe-ids-range", "expert_ids known at the call, past E = E_local * axis size",
     lambda: _moe(ids=lambda ids: np.full((4, 1), 2, np.int32)), ValueError,
     r"expert_parallel\(expert_ids=\.\.\.\) holds 2, outside \[0, E\) = "
     r"\[0, 2\): E = E_local \* axis size = 1 \* 2"),
    ("moe-weights-shape", "weights of another shape than expert_ids",
     lambda: _moe(w=lambda w: w[:, :0]), ValueError,
     r"expert_parallel\(weights=\.\.\.\) must have the shape of expert_ids, "
     r"\[T, k\] = \(4, 1\)"),
    ("moe-params-leading", "expert_params leaves over different numbers of experts",
     lambda: _moe(params=lambda p: {"a": p, "b": jnp.ones((2, 4, 4))}), ValueError,
     r"expert_parallel\(expert_params=\.\.\.\): the leading \(E_local\) "
     r"dimension differs between leaves: \{\"\['a'\]\": 1, \"\['b'\]\": 2\}"),
    ("moe-params-replicated", "expert_params replicated over the axis (in_specs P())",
     lambda: _moe(params_spec=P()), ValueError,
     r"expert_parallel\(expert_params=\.\.\.\): leaf \(expert_params itself\) "
     r"does not vary over axis 'i'.*Shard the expert dimension over 'i'"),
    ("moe-chunks-divide", "T = 4 tokens in chunks=3",
     lambda: _moe(chunks=3), ValueError,
     r"expert_parallel\(chunks=3\): x has T = 4 tokens, which 3 chunks cannot "
     r"split evenly\. Give chunks dividing T \(one of \[1, 2, 4\]\)"),
    ("moe-chunks", "chunks=0", lambda: _moe(chunks=0), ValueError,
     r"expert_parallel\(chunks=\.\.\.\) must be an int >= 1, got 0"),
    ("moe-capacity", "capacity=0 (capacity=1.5: TypeError)",
     lambda: _moe(capacity=0), ValueError,
     r"expert_parallel\(capacity=\.\.\.\) must be an int >= 1 .* or None "
     r"\(dropless\), got 0"),
    ("moe-expert-output", "an expert_fn that returns one value, not a row per token",
     lambda: _moe(fn=lambda p, t: jnp.sum(t @ p)), ValueError,
     r"expert_parallel\(expert_fn=\.\.\.\) must return one row per token, "
     r"\[C, D'\], for tokens \[C, D\]"),
    # --- pipeline_loss ---------------------------------------------------------------
    ("pipeline-axis", "pipeline_loss outside shard_map (or over an unbound axis)",
     lambda: jo.pipeline_loss(lambda w, x: x @ w, lambda y, t: jnp.mean(y - t),
                              jnp.ones((2, 4, 4)), jnp.ones((4, 2, 4)),
                              jnp.ones((4, 2, 4)), axis="i"), ValueError,
     r"pipeline_loss\(axis='i'\): no mesh axis of that name is bound here; "
     r"call pipeline_loss inside jax\.shard_map over that axis"),
    ("pipeline-schedule", "schedule='pipedream' (not a schedule)",
     lambda: _pipeline(schedule="pipedream"), ValueError,
     r"schedule='pipedream': expected one of \('gpipe', '1f1b', 'interleaved', "
     r"'zb-h1', 'zb-v', 'dualpipev'\)"),
    ("pipeline-stage-params", "stage_params without a leading axis of virtual_stages",
     lambda: _pipeline(schedule="interleaved", virtual_stages=2), ValueError,
     r"stage_params has shape \(1, 4, 4\) inside shard_map: its leading axis must "
     r"be virtual_stages=2 .*pipeline_stage_layout"),
    ("pipeline-xs", "xs with no microbatch axis (a scalar)",
     lambda: _pipeline(xs=jnp.float32(1)), ValueError,
     r"xs has leaves of shapes \[\(\)\]: expected the m microbatches stacked on "
     r"axis 0"),
    ("pipeline-targets", "targets over another number of microbatches than xs",
     lambda: _pipeline(ts=jnp.zeros((3, 2, 4))), ValueError,
     r"targets has shape \(3, 2, 4\): expected the 4 microbatches of xs"),
    ("pipeline-microbatches", "schedule='1f1b' with fewer microbatches than stages",
     lambda: _pipeline(xs=jnp.ones((1, 2, 4)), ts=jnp.zeros((1, 2, 4))), ValueError,
     r"schedule='1f1b' needs microbatches >= stages \(got microbatches=1, "
     r"stages=2\)"),
    ("pipeline-virtual-stages", "virtual_stages=2 with a one-chunk schedule",
     lambda: _pipeline(w=jnp.ones((4, 4, 4)), virtual_stages=2), ValueError,
     r"schedule='1f1b' runs one chunk a device: got virtual_stages=2; use "
     r"schedule='interleaved'"),
    ("pipeline-interleaved-one", "schedule='interleaved' with virtual_stages=1",
     lambda: _pipeline(schedule="interleaved"), ValueError,
     r"schedule='interleaved' needs virtual_stages >= 2 \(got 1\)"),
    ("pipeline-zb-v-chunks", "schedule='zb-v' without virtual_stages=2",
     lambda: _pipeline(schedule="zb-v"), ValueError,
     r"schedule='zb-v' runs two chunks a device on a V \(device d holds stages d "
     r"and 2p-1-d\): got virtual_stages=1; pass virtual_stages=2"),
    ("pipeline-dualpipev-chunks", "schedule='dualpipev' without virtual_stages=2",
     lambda: _pipeline(schedule="dualpipev"), ValueError,
     r"schedule='dualpipev' runs two chunks a device on a V \(device d holds "
     r"stages d and 2p-1-d\): got virtual_stages=1; pass virtual_stages=2"),
    ("pipeline-dualpipev-microbatches", "schedule='dualpipev' with fewer than 2p microbatches",
     lambda: _pipeline(w=jnp.ones((4, 4, 4)), xs=jnp.ones((3, 2, 4)),
                       ts=jnp.zeros((3, 2, 4)), schedule="dualpipev",
                       virtual_stages=2), ValueError,
     r"schedule='dualpipev' needs microbatches >= 2 \* stages \(got "
     r"microbatches=3, stages=2\)"),
    ("pipeline-interleaved-m", "schedule='interleaved' with microbatches not a multiple of stages",
     lambda: _pipeline(w=jnp.ones((4, 4, 4)), xs=jnp.ones((3, 2, 4)),
                       ts=jnp.zeros((3, 2, 4)), schedule="interleaved",
                       virtual_stages=2), ValueError,
     r"schedule='interleaved' needs microbatches to be a multiple of stages: "
     r"got microbatches=3, stages=2"),
    ("pipeline-xs-sharded", "xs sharded over the pipeline axis (in_specs P('i'))",
     lambda: _pipeline(xs=jnp.ones((8, 2, 4)), ts=jnp.zeros((4, 2, 4)),
                       xs_spec=P("i")), ValueError,
     r"xs is sharded over the pipeline axis 'i' \(its in_specs entry names it\)"),
    ("pipeline-dispatch", "dispatch='eager'", lambda: _pipeline(dispatch="eager"),
     ValueError, r"pipeline_loss\(dispatch='eager'\): expected one of \('switch', "
     r"'lockstep'\) or None"),
    ("pipeline-send-ticks", "send_ticks=-1", lambda: _pipeline(send_ticks=-1),
     ValueError, r"send_ticks=-1: expected None or an int >= 0"),
    ("pipeline-stages", "pipeline_schedule with one stage",
     lambda: jo.pipeline_schedule("gpipe", 1, 4), ValueError,
     r"stages=1: a pipeline needs at least 2 stages"),
    ("pipeline-stage-shape", "a stage_fn that changes the activation's shape",
     lambda: _pipeline(stage_fn=lambda w, x: (x @ w)[:, :2]), ValueError,
     r"stage_fn must return an activation of its input's structure, shapes and "
     r"dtypes, float32\[2, 4\]; it returned float32\[2, 2\]"),
    ("pipeline-stage-collective", "a collective over the pipeline axis inside stage_fn",
     lambda: _pipeline(stage_fn=lambda w, x: lax.psum(x @ w, "i")), ValueError,
     r"stage_fn holds a collective over the pipeline axis 'i': each device runs "
     r"another stage"),
    ("pipeline-loss-scalar", "a loss_fn that returns an array, not a scalar",
     lambda: _pipeline(loss_fn=lambda y, t: (y - t) ** 2), ValueError,
     r"loss_fn must return a scalar \(the loss of one microbatch\)"),
    ("pipeline-second-derivative", "grad of grad (or jax.hessian) of pipeline_loss",
     lambda: _pipeline(order=2), NotImplementedError,
     r"pipeline_loss has first derivatives only"),
    ("pipeline-layout", "pipeline_stage_layout of 3 stages over stages=2",
     lambda: jo.pipeline_stage_layout(jnp.ones((3, 4)), 2), ValueError,
     r"pipeline_stage_layout: a leaf's leading axis is 3, not a multiple of "
     r"stages=2"),
    ("pipeline-layout-schedule", "pipeline_stage_layout with an unknown schedule",
     lambda: jo.pipeline_stage_layout(jnp.ones((4, 4)), 2, schedule="zbv"),
     ValueError, r"pipeline_stage_layout\(schedule='zbv'\): expected None or one of"),
    ("pipeline-layout-zb-v", "pipeline_stage_layout(schedule='zb-v') of other than 2p stages",
     lambda: jo.pipeline_stage_layout(jnp.ones((6, 4)), 2, schedule="zb-v"),
     ValueError, r"the V \(ZB-V, DualPipeV\) holds 2 stages a device, 2\*stages=4"),
    # --- ring_attention, ulysses_attention, to_layout -------------------------------------
    ("attention-rank", "q of 3 dimensions (no heads axis)",
     lambda: _attention(jo.ring_attention, q=(1, 8, 64)), ValueError,
     r"ring_attention: q must be \(batch, seq_local, heads, head_dim\), got "
     r"shape \(1, 4, 64\)"),
    ("attention-kv-shapes", "k and v of different shapes",
     lambda: _attention(jo.ring_attention, v=(1, 8, 1, 8)), ValueError,
     r"ring_attention: k and v must have one shape"),
    ("attention-seq-differs", "q's sequence length differs from k's (ulysses_attention too)",
     lambda: _attention(jo.ring_attention, k=(1, 4, 2, 8)), ValueError,
     r"ring_attention: q's sequence length \(4, shape \(1, 4, 8, 8\)\) differs "
     r"from k's and v's \(2"),
    ("attention-head-dim", "q and k with different head_dim (or batch)",
     lambda: _attention(jo.ring_attention, k=(1, 8, 2, 4)), ValueError,
     r"ring_attention: q \(shape \(1, 4, 8, 8\)\) and k, v \(shape \(1, 4, 2, 4\)\) "
     r"must agree in batch and head_dim"),
    ("attention-kv-heads", "kv_heads that do not divide heads",
     lambda: _attention(jo.ring_attention, k=(1, 8, 3, 8)), ValueError,
     r"ring_attention: kv_heads \(3\) must divide heads \(8\)"),
    ("attention-segment-ids-shape", "segment_ids of another shape than (batch, seq_local)",
     lambda: _attention(jo.ring_attention, segment_ids=jnp.zeros((1, 3), jnp.int32)),
     ValueError, r"ring_attention: segment_ids must be \(batch, seq_local\) = "
     r"\(1, 4\)"),
    ("attention-segment-ids-dtype", "segment_ids of floats",
     lambda: _attention(jo.ring_attention, segment_ids=jnp.zeros((1, 4))),
     TypeError, r"ring_attention: segment_ids must be integers, got float32"),
    ("attention-axis", "an axis that shard_map did not bind",
     lambda: _attention(jo.ring_attention, axis="cp"), NameError,
     r"ring_attention\(axis='cp'\): no mesh axis named 'cp' is bound here"),
    ("attention-axes", "a tuple of axes",
     lambda: _attention(jo.ring_attention, axis=("i",)), TypeError,
     r"ring_attention\(axis=\('i',\)\): give one mesh axis name"),
    ("attention-scale", "scale=[0.5] (not a number)",
     lambda: _attention(jo.ring_attention, scale=[0.5]), TypeError,
     r"ring_attention\(scale=\[0\.5\]\) must be a Python number"),
    ("attention-causal", "causal=None (ulysses_attention likewise)",
     lambda: _attention(jo.ring_attention, causal=None), TypeError,
     r"ring_attention\(causal=None\) must be True or False"),
    ("ring-unknown-layout", "layout='striped' (to_layout, from_layout likewise)",
     lambda: _attention(jo.ring_attention, layout="striped"), ValueError,
     r"ring_attention\(layout='striped'\): unknown layout; give one of "
     r"'contiguous', 'zigzag'"),
    ("ring-layout-mismatch", "layout='zigzag' on an odd local sequence (not laid out by to_layout)",
     lambda: _attention(jo.ring_attention, q=(1, 6, 8, 8), k=(1, 6, 2, 8),
                        layout="zigzag"), ValueError,
     r"ring_attention\(layout='zigzag'\): each device holds 2 chunks of the "
     r"sequence, but seq_local is 3"),
    ("layout-not-divisible", "to_layout of a sequence that 2p chunks cannot split (from_layout likewise)",
     lambda: jo.to_layout(jnp.zeros((1, 12)), "zigzag", 4), ValueError,
     r"to_layout: the sequence \(axis 1 of shape \(1, 12\)\) has length 12, "
     r"which layout 'zigzag' cannot split into 8 equal chunks"),
    ("layout-axis-size", "to_layout(..., axis_size=0)",
     lambda: jo.to_layout(jnp.zeros((1, 12)), "zigzag", 0), ValueError,
     r"to_layout\(axis_size=0\) must be a positive int"),
    ("ulysses-heads", "heads that are not a multiple of the axis size",
     lambda: _attention(jo.ulysses_attention, q=(1, 8, 3, 8), k=(1, 8, 1, 8)),
     ValueError, r"ulysses_attention: heads \(3, q shape \(1, 4, 3, 8\)\) must be "
     r"a multiple of the 2 devices of axis 'i'"),
    ("ulysses-causal-fn", "causal=True with an attention_fn",
     lambda: _attention(jo.ulysses_attention, attention_fn=lambda q, k, v: q,
                        causal=True), ValueError,
     r"ulysses_attention: causal=True applies to the default kernel only"),
    ("ulysses-attention-fn", "attention_fn=42 (not a function)",
     lambda: _attention(jo.ulysses_attention, attention_fn=42), TypeError,
     r"ulysses_attention\(attention_fn=42\) must be callable"),
    ("attention-implementation", "implementation='triton' (ulysses_attention likewise)",
     lambda: _attention(jo.ring_attention, implementation="triton"), ValueError,
     r"ring_attention\(implementation='triton'\): give None \(the Pallas TPU "
     r"flash kernel on TPU, XLA elsewhere\), 'xla' or 'pallas'"),
    ("attention-pallas-interpreter", "implementation='pallas' on CPU in a shard_map that checks varying axes",
     lambda: _attention(jo.ring_attention, implementation="pallas"), ValueError,
     r"implementation='pallas' on cpu runs the TPU kernel in Pallas's "
     r"interpreter, which fails inside a jax\.shard_map that checks varying "
     r"axes; give jax\.shard_map\(\.\.\., check_vma=False\)"),
    ("ulysses-implementation-fn", "implementation= with an attention_fn",
     lambda: _attention(jo.ulysses_attention, attention_fn=lambda q, k, v: q,
                        implementation="xla"), ValueError,
     r"ulysses_attention: implementation= chooses the default kernel's code; "
     r"give it or attention_fn, not both"),
    # --- overlap_report (inspect) ------------------------------------------------------
    ("inspect-not-callable", "overlap_report(3)",
     lambda: jo.overlap_report(3), TypeError,
     r"overlap_report\(fn=\.\.\.\) must be a function"),
    ("inspect-schedule", "overlap_report(f, schedule='fast')",
     lambda: jo.overlap_report(body, schedule="fast"), ValueError,
     r"overlap_report\(schedule=\.\.\.\) must be 'compiled', 'written' or None"),
    ("inspect-hardware", "an unknown hardware profile",
     lambda: jo.overlap_report(body, hardware="tpu-v99"), jo.HardwareProfileError,
     r"tpu-v99"),
    ("hlo-malformed", "a truncated HLO dump",
     lambda: jo.OverlapReport.from_hlo(
         "HloModule m, is_scheduled=true\nENTRY %main (p: f32[4]) -> f32[4] {\n"
         "  %p = f32[4]{0} parameter(0"),
     jo.HloParseError, r"<text>:3: this instruction is not finished when the text ends"),
    # --- measure -----------------------------------------------------------------------
    ("measure-steps", "measure(f, steps=0)",
     lambda: jo.measure(body, steps=0), ValueError,
     r"measure\(steps=\.\.\.\) must be an int >= 1"),
    ("measure-not-callable", "measure(3)",
     lambda: jo.measure(3), TypeError, r"measure\(fn=\.\.\.\) must be a function"),
    ("profile-missing", "a profile path that does not exist",
     lambda: jo.MeasuredReport.from_profile("/nonexistent/run"),
     jo.ProfileReadError, r"no such file or directory: '/nonexistent/run'"),
]


@pytest.mark.parametrize("row", MISUSES, ids=[r[0] for r in MISUSES])
def test_misuse(row):
  _, _, call, error, pattern = row
  if row[0] in ("fsdp-shard-dims-explicit", "fsdp-layer-dim-sharded") \
      and not HAS_EXPLICIT:
    pytest.skip("this jax lacks AxisType.Explicit or jax.reshard")
  with pytest.raises(error, match=pattern) as info:
    call()
  if row[0] == "static-argument":
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "program_order(functools.partial(f, n=3), enforce=True)" in notes, notes


def test_future_dropped_eagerly_warns_when_collected():
  f = jax.shard_map(lambda v: (jo.psum_start(v, "i"), v)[1], mesh=MESH,
                    in_specs=P("i"), out_specs=P("i"))
  with pytest.warns(jo.FutureNotFinishedWarning,
                    match=rf"psum_start started at .*{HERE}.* was never finished"):
    f(X)
    gc.collect()


@pytest.mark.parametrize("donate", [False, True])
def test_donated_argument_is_not_a_silent_wrong_answer(donate):
  f = jo.program_order(lambda x, y: (jnp.sin(x) * y, jnp.cos(y)), enforce=True)
  kw = dict(donate_argnums=(0,)) if donate else {}
  want = (np.sin(np.arange(4.0)) * 2, np.cos(np.full(4, 2.0)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")     # CPU may not use every donation
    got = jax.jit(f, **kw)(jnp.arange(4.0), jnp.full(4, 2.0))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_static_argument_through_partial_works():
  f = jo.program_order(functools.partial(lambda x, n: jnp.ones((n,)) * x.sum(),
                                         n=3), enforce=True)
  got = jax.jit(f)(X)
  np.testing.assert_allclose(np.asarray(got), np.full(3, float(X.sum())), rtol=1e-6)


def test_docs_list_every_row():
  text = DOC.read_text()
  rows = re.findall(r"^\| `([\w-]+)` \|", text, re.M)
  assert rows == [r[0] for r in MISUSES], set(rows) ^ {r[0] for r in MISUSES}
  for rid, _, _, error, _ in MISUSES:
    line = next(l for l in text.splitlines() if l.startswith(f"| `{rid}` |"))
    assert f"`{error.__name__}`" in line, (rid, error.__name__)
