"""Random JAX programs as data, for differential fuzzing of `program_order`.

A program is a small tree of records (`Program`, `Block`, `Op`) that
hypothesis draws (`programs()`) and shrinks; its `repr` is the Python code
that rebuilds it, so a shrunk failure can be pasted into a regression test.
`build` turns a program into a function two ways: with `program_order` (ours,
or jax's own) and our futures, or with the decorator replaced by the
identity and every future by the synchronous `jax.lax` collective.

`contract_counts` is an independent count of the barriers and tokens the
docs/program-order.md's contract ("Where barriers go in an ordered block") puts in a traced
program; `stablehlo_counts` reads the same numbers from lowered StableHLO
text. Neither calls the library's barrier code.

Values: every record reads earlier values by index. A body's values are its
arguments, then the values it reads by closure, then each record's results
in turn (a block's results are its `outs`).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax
from jax._src import core
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo

# --- the records ------------------------------------------------------------------

UNARY = ("sin", "cos", "tanh", "neg", "abs", "square", "half", "exp", "logistic")
BINARY = ("add", "sub", "mul", "max", "min")
COLLECTIVES = ("psum", "all_gather", "psum_scatter", "all_to_all", "ppermute")
POLICIES = ("nothing_saveable", "everything_saveable", "dots_saveable",
            "save_only_a", "default")
STRICT = (False, True, (True, False), (False, True))


class Op(NamedTuple):
  """One operation on earlier values.

  kind / args / param:
    unary (a,) name in UNARY;  binary (a, b) name in BINARY (b may be a
    scalar);  dot (a, b);  reduce (a,) ("sum" | "max", axis);
    broadcast (a,) "front" | "back" (a new axis of 2);  reshape (a,) new
    shape;  slice (a,) (first half of axis 0);  where (c, a, b)
    (where(c > 0, a, b));  iota () shape;  full () (shape, value);
    scalar () value (a concrete np.float32: a literal where it is used);
    array () (shape, seed) (a numpy constant, closed over);  name (a,) name
    (checkpoint_name);  collective (a,) name in COLLECTIVES;
    start (a,) name (our future);  done (future,).
  """
  kind: str
  args: tuple = ()
  param: Any = None

  def __repr__(self):
    return f"Op({self.kind!r}, {self.args!r}, {self.param!r})"


class Block(NamedTuple):
  """A nested function, called where it stands.

  kind / param:
    ordered: program_order(enforce=True, strict_in_out=param)
    free: program_order(enforce=False, exclude_argnames=...), param =
      (excluded argument positions, call by keyword)
    plain: no decorator (only as a program's top block)
    jit: jax.jit;  checkpoint: jax.checkpoint(policy=param)
    cond: lax.cond(sum(args[0]) > 0, body, orelse, *args[1:])
    scan: lax.scan over `param` steps; carries are args, outs are the new
      carries then the per-step outputs (stacked)
  """
  kind: str
  args: tuple
  body: tuple
  outs: tuple
  param: Any = None
  closure: tuple = ()
  orelse: tuple = ()
  orelse_outs: tuple = ()

  def __repr__(self):
    return _show(self, 0)


class Program(NamedTuple):
  """A function of `inputs` (per-device shapes): the `top` block, inside
  `jax.shard_map` over a 2-device axis "i" when `sharded`."""
  inputs: tuple
  top: Block
  sharded: bool = False
  remat3: bool = False

  def __repr__(self):
    return (f"Program(\n    inputs={self.inputs!r}, sharded={self.sharded!r}, "
            f"remat3={self.remat3!r},\n    top={_show(self.top, 4)})")


def _show(block: Block, indent: int) -> str:
  pad = " " * (indent + 4)

  def records(rs):
    if not rs:
      return "()"
    lines = [pad + "  " + (_show(r, indent + 6) if isinstance(r, Block)
                           else repr(r)) + "," for r in rs]
    return "(\n" + "\n".join(lines) + "\n" + pad + ")"
  fields = [f"{block.kind!r}", f"args={block.args!r}",
            f"body={records(block.body)}", f"outs={block.outs!r}"]
  if block.param is not None:
    fields.append(f"param={block.param!r}")
  if block.closure:
    fields.append(f"closure={block.closure!r}")
  if block.kind == "cond":
    fields += [f"orelse={records(block.orelse)}",
               f"orelse_outs={block.orelse_outs!r}"]
  return "Block(" + (",\n" + pad).join(fields) + ")"


def walk(program: Program):
  """Every record of `program`, blocks before their bodies."""
  def visit(rs):
    for r in rs:
      yield r
      if isinstance(r, Block):
        yield from visit(r.body)
        yield from visit(r.orelse)
  yield program.top
  yield from visit(program.top.body)


def has_futures(program: Program) -> bool:
  return any(isinstance(r, Op) and r.kind == "start" for r in walk(program))


def returns_a_value_again(program: Program) -> bool:
  """True when an ordered or free block returns one of its inputs, or one
  value twice: its equation makes a new variable for each output where the
  undecorated function hands back the same one (see the xfail in
  tests/integration/fuzz_regressions_test.py)."""
  for r in walk(program):
    if isinstance(r, Block) and r.kind in ("ordered", "free"):
      n_in = len(r.args) + len(r.closure)
      if any(o < n_in for o in r.outs) or len(set(r.outs)) < len(r.outs):
        return True
  return False


# Ops whose bits may change when XLA fuses differently (a barrier changes
# fusion): transcendental functions, sums whose order XLA picks, and
# products, which a fusion may contract with a following add into one
# fused multiply-add (seen in jvps: x * t + t * y).
INEXACT_UNARY = ("sin", "cos", "tanh", "exp", "logistic", "square")
EXACT_UNARY = tuple(u for u in UNARY if u not in INEXACT_UNARY)
EXACT_BINARY = tuple(b for b in BINARY if b != "mul")


def is_exact(program: Program) -> bool:
  """True when every op gives the same bits however XLA fuses it."""
  for r in walk(program):
    if isinstance(r, Op) and (r.kind == "dot" or
                              (r.kind == "reduce" and r.param[0] == "sum") or
                              (r.kind == "unary" and r.param in INEXACT_UNARY) or
                              (r.kind == "binary" and r.param == "mul")):
      return False
  return True


# --- drawing programs --------------------------------------------------------------

LIMIT = 16.0      # the largest magnitude a value may reach; tanh bounds more
MAX_SIZE = 64     # elements of the largest value
MAX_DEPTH = 3     # nested blocks
INPUT_SHAPES = ((4, 4), (4,), (8,), (2, 4))


class _Val(NamedTuple):
  """What the generator knows of a value."""
  shape: tuple
  bound: float            # |value| <= bound
  varying: bool           # differs across the shard_map axis
  future: str | None = None   # a future of this collective; shape of done()
  literal: bool = False   # a concrete scalar


class _Body:
  """Values and pending futures of one body being drawn."""

  def __init__(self, vals, *, futures_ok, collectives_ok, returns_futures):
    self.vals: list[_Val] = list(vals)
    self.records: list = []
    self.used: set[int] = set()
    self.pending: set[int] = {i for i, v in enumerate(self.vals) if v.future}
    self.futures_ok = futures_ok
    self.collectives_ok = collectives_ok
    self.returns_futures = returns_futures

  def arrays(self, pred=lambda v: True):
    return [i for i, v in enumerate(self.vals) if v.future is None and pred(v)]

  def add(self, record, vals):
    self.records.append(record)
    for i in record.args:
      self.used.add(i)
      self.pending.discard(i)
    for i in getattr(record, "closure", ()):
      self.used.add(i)
    start = len(self.vals)
    self.vals.extend(vals)
    self.pending |= {start + k for k, v in enumerate(vals) if v.future}


class _Drawer:
  """Draws one program's records; hypothesis shrinks the draws."""

  def __init__(self, draw, *, sharded, futures, budget, exact):
    self.draw = draw
    self.exact = exact
    self.sharded = sharded
    self.futures = futures and sharded
    self.budget = budget

  def pick(self, candidates):
    """One of `candidates`; shrinks towards the last (the most recent)."""
    k = self.draw(st.integers(0, len(candidates) - 1))
    return candidates[len(candidates) - 1 - k]

  # The body of a block: records, then the outputs.
  def body(self, vals, *, depth, n_ops, out_like=None, futures_ok=True,
           collectives_ok=True, returns_futures=False):
    b = _Body(vals, futures_ok=futures_ok and self.futures,
              collectives_ok=collectives_ok and self.sharded,
              returns_futures=returns_futures)
    for _ in range(n_ops):
      if self.budget <= 0:
        break
      self.budget -= 1
      self.record(b, depth)
    return b, self.outputs(b, out_like)

  def outputs(self, b: _Body, out_like):
    for i in sorted(b.pending):
      if not (b.returns_futures and self.draw(st.booleans())):
        self.done(b, i)
    if out_like is not None:
      # cond branches and scan carries: one value like each of `out_like`.
      outs = []
      for want in out_like:
        fits = b.arrays(lambda v: v.shape == want.shape and
                        v.varying == want.varying and not v.literal)
        outs.append(self.pick(fits))
      return tuple(outs)
    made = range(len(b.vals) - sum(len(_results(r)) for r in b.records),
                 len(b.vals))
    leaves = [i for i in made if i not in b.used and
              (b.vals[i].future is None or i in b.pending)]
    outs = [i for i in leaves if not self.draw(st.booleans())]  # drop: dead code
    outs += [i for i in sorted(b.pending) if i not in outs]
    # Now and then an input, or a value twice.
    extra = self.draw(st.sampled_from((0,) * 8 + (1, 2)))
    outs += [self.pick(b.arrays()) for _ in range(extra)]
    if not outs:
      made_arrays = [i for i in made if b.vals[i].future is None]
      outs = [made_arrays[-1] if made_arrays else self.pick(b.arrays())]
    return tuple(outs)

  def done(self, b: _Body, i):
    v = b.vals[i]
    b.add(Op("done", (i,)), [v._replace(future=None)])

  # One record.
  def record(self, b: _Body, depth):
    kinds = ["unary", "binary", "reduce", "broadcast", "reshape", "slice",
             "where", "dot", "iota", "full", "scalar", "array", "name"]
    if b.collectives_ok and b.arrays(lambda v: v.varying):
      kinds += ["collective"] * 2
      if b.futures_ok:
        kinds += ["start"] * 2
    if b.pending:
      kinds.append("done")
    if depth < MAX_DEPTH and self.budget >= 1:
      kinds += ["ordered", "free", "jit", "checkpoint", "scan", "cond"]
    kind = self.draw(st.sampled_from(kinds))
    if not b.arrays() and kind not in ("iota", "full", "scalar", "array",
                                       "done", "ordered", "free", "jit"):
      kind = "full"
    if kind in ("ordered", "free", "jit", "checkpoint", "scan", "cond"):
      return self.block(b, kind, depth)
    if kind == "done":
      return self.done(b, self.pick(sorted(b.pending)))
    op, val = self.op(b, kind)
    if val.bound > LIMIT and op.args:   # keep values finite: squash instead
      op, val = Op("unary", (op.args[0],), "tanh"), \
          b.vals[op.args[0]]._replace(bound=1.0, literal=False)
    b.add(op, [val])

  def some_shape(self, b: _Body):
    shapes = sorted({b.vals[i].shape for i in b.arrays()}) or [(4,)]
    return self.pick(shapes)

  def op(self, b: _Body, kind):
    draw = self.draw
    if kind in ("iota", "full", "scalar", "array"):
      shape = self.some_shape(b)
      if kind == "iota":
        shape = shape or (4,)
        return Op("iota", (), shape), _Val(shape, shape[0] - 1.0, False)
      if kind == "full":
        value = draw(st.sampled_from((2.0, -0.5, 1.0)))
        return Op("full", (), (shape, value)), _Val(shape, abs(value), False)
      if kind == "scalar":
        value = draw(st.sampled_from((3.0, -0.5, 0.25)))
        return Op("scalar", (), value), _Val((), abs(value), False, literal=True)
      seed = draw(st.integers(0, 3))
      return Op("array", (), (shape, seed)), _Val(shape, 1.0, False)
    if kind in ("collective", "start"):
      a = self.pick(b.arrays(lambda v: v.varying))
      va = b.vals[a]
      names = [n for n in COLLECTIVES
               if _collective_shape(n, va.shape) is not None]
      name = draw(st.sampled_from(names))
      shape = _collective_shape(name, va.shape)
      bound = va.bound * (2 if name in ("psum", "psum_scatter") else 1)
      val = _Val(shape, bound, name != "psum")
      if kind == "start":
        return Op("start", (a,), name), val._replace(future=name)
      return Op("collective", (a,), name), val
    a = self.pick(b.arrays())
    va = b.vals[a]
    if kind == "unary":
      name = draw(st.sampled_from(EXACT_UNARY if self.exact else UNARY))
      bound = {"sin": 1.0, "cos": 1.0, "tanh": 1.0, "logistic": 1.0,
               "square": va.bound ** 2, "half": va.bound / 2,
               "exp": float(np.exp(va.bound))}.get(name, va.bound)
      return Op("unary", (a,), name), va._replace(bound=bound, literal=False)
    if kind == "binary":
      c = self.pick(b.arrays(lambda v: v.shape == va.shape or v.shape == ()))
      vc = b.vals[c]
      name = draw(st.sampled_from(EXACT_BINARY if self.exact else BINARY))
      bound = {"add": va.bound + vc.bound, "sub": va.bound + vc.bound,
               "mul": va.bound * vc.bound}.get(name, max(va.bound, vc.bound))
      return Op("binary", (a, c), name), _Val(
          va.shape, bound, va.varying or vc.varying)
    if kind == "reduce" and va.shape:
      fn = "max" if self.exact else draw(st.sampled_from(("sum", "max")))
      axis = draw(st.integers(0, len(va.shape) - 1))
      shape = va.shape[:axis] + va.shape[axis + 1:]
      bound = va.bound * (va.shape[axis] if fn == "sum" else 1)
      return Op("reduce", (a,), (fn, axis)), _Val(shape, bound, va.varying)
    if kind == "broadcast" and len(va.shape) < 3 and 2 * _size(va.shape) <= MAX_SIZE:
      where = draw(st.sampled_from(("front", "back")))
      shape = (2, *va.shape) if where == "front" else (*va.shape, 2)
      return Op("broadcast", (a,), where), va._replace(shape=shape, literal=False)
    if kind == "reshape":
      shape = _reshaped(va.shape)
      if shape is not None:
        return Op("reshape", (a,), shape), va._replace(shape=shape)
    if kind == "slice" and va.shape and va.shape[0] >= 2:
      shape = (va.shape[0] // 2, *va.shape[1:])
      return Op("slice", (a,)), va._replace(shape=shape)
    if kind == "where":
      c = self.pick(b.arrays(lambda v: v.shape == va.shape or v.shape == ()))
      d = self.pick(b.arrays(lambda v: v.shape == va.shape))
      vc, vd = b.vals[c], b.vals[d]
      return Op("where", (c, a, d)), _Val(
          va.shape, max(va.bound, vd.bound), va.varying or vc.varying or vd.varying)
    if kind == "dot" and 1 <= len(va.shape) <= 2 and not self.exact:
      fits = b.arrays(lambda v: 1 <= len(v.shape) <= 2 and v.shape[0] == va.shape[-1])
      if fits:
        c = self.pick(fits)
        vc = b.vals[c]
        shape = va.shape[:-1] + vc.shape[1:]
        return Op("dot", (a, c)), _Val(
            shape, va.bound * vc.bound * va.shape[-1], va.varying or vc.varying)
    if kind == "name":
      name = draw(st.sampled_from(("a", "b")))
      return Op("name", (a,), name), va._replace(literal=False)
    # Not applicable here: the simplest op instead.
    return Op("unary", (a,), "neg"), va._replace(literal=False)

  def fallback(self, b: _Body):
    op, val = self.op(b, "unary")
    b.add(op, [val])

  def block(self, b: _Body, kind, depth):
    draw = self.draw
    carries_futures = kind in ("ordered", "free", "jit")
    # Arguments: arrays, and (into blocks that may finish them) futures.
    n_args = draw(st.integers(0 if kind in ("ordered", "free", "jit") else 1, 3))
    if not b.arrays():
      n_args = 0
    args = []
    for _ in range(n_args):
      if carries_futures and b.pending and draw(st.booleans()):
        cands = sorted(i for i in b.pending if i not in args)
      else:
        cands = b.arrays(lambda v: kind not in ("scan", "cond") or not v.literal)
      if cands:
        args.append(self.pick(cands))
    if kind in ("scan", "cond") and not args:
      return self.fallback(b)
    n_closure = draw(st.integers(0, 2)) if b.arrays() else 0
    closure = tuple(sorted({self.pick(b.arrays()) for _ in range(n_closure)}))
    if kind == "cond":
      pred, args = args[0], args[1:]
      if b.collectives_ok and b.vals[pred].varying:
        fits = b.arrays(lambda v: not v.varying)
        if not fits:
          return self.fallback(b)
        pred = self.pick(fits)
    n_ops = draw(st.integers(1, max(1, min(8, self.budget))))
    inner = [b.vals[i] for i in args] + [b.vals[i] for i in closure]
    inner = [v._replace(literal=False) if kind == "scan" else v for v in inner]
    # Futures may be used anywhere, but cross only block and jit boundaries.
    # Collectives may run in cond branches: the predicate is the same on
    # every device.
    opts = dict(depth=depth + 1, futures_ok=b.futures_ok,
                collectives_ok=b.collectives_ok,
                returns_futures=carries_futures)
    param = None
    if kind == "ordered":
      param = draw(st.sampled_from(STRICT))
    elif kind == "free":
      excluded = tuple(i for i in range(len(args)) if draw(st.booleans()))
      param = (excluded, draw(st.booleans()))
    elif kind == "checkpoint":
      param = draw(st.sampled_from(POLICIES))
    elif kind == "scan":
      param = draw(st.integers(1, 3))
    out_like = [b.vals[i]._replace(literal=False) for i in args] \
        if kind in ("scan", "cond") else None
    if kind == "cond":
      inner = [b.vals[i] for i in args] + [b.vals[i] for i in closure]
    body, outs = self.body(inner, n_ops=n_ops, out_like=out_like, **opts)
    out_vals = [body.vals[i] for i in outs]
    orelse, orelse_outs = (), ()
    if kind == "scan":
      fits = body.arrays(lambda v: not v.literal and
                         param * _size(v.shape) <= MAX_SIZE)
      if fits and draw(st.booleans()):   # a per-step output too
        ys = self.pick(fits)
        outs = outs + (ys,)
        vy = body.vals[ys]
        out_vals.append(vy._replace(shape=(param, *vy.shape)))
      out_vals = [v._replace(literal=False) for v in out_vals]
    if kind == "cond":
      n_else = draw(st.integers(1, max(1, min(4, self.budget))))
      other, orelse_outs = self.body(inner, n_ops=n_else, out_like=out_like, **opts)
      orelse = tuple(other.records)
      out_vals = [v._replace(bound=max(v.bound, other.vals[j].bound))
                  for v, j in zip(out_vals, orelse_outs)]
      args = (pred, *args)
    block = Block(kind, tuple(args), tuple(body.records), tuple(outs), param,
                  closure, orelse, orelse_outs)
    b.add(block, out_vals)


def _results(record) -> tuple:
  return record.outs if isinstance(record, Block) else (None,)


def _size(shape) -> int:
  return int(np.prod(shape, dtype=int))


def _reshaped(shape):
  if len(shape) >= 2:
    return (*shape[:-2], shape[-2] * shape[-1])
  if len(shape) == 1 and shape[0] >= 4 and shape[0] % 2 == 0:
    return (2, shape[0] // 2)
  return None


def _collective_shape(name, shape):
  """The result shape of `name` over 2 devices; None where it can't run."""
  if name in ("psum", "ppermute"):
    return shape
  if not shape:
    return None
  if name == "all_gather":
    return (2 * shape[0], *shape[1:]) if 2 * _size(shape) <= MAX_SIZE else None
  if shape[0] % 2:
    return None
  return (shape[0] // 2, *shape[1:]) if name == "psum_scatter" else shape


@st.composite
def programs(draw, *, futures=True, sharded=None, min_ops=5, max_ops=40):
  """Random programs of `min_ops` to `max_ops` records. `futures=False`
  draws none of our futures (jax's own program_order can run those)."""
  if sharded is None:
    sharded = draw(st.booleans())
  budget = draw(st.integers(min_ops, max_ops))
  n_in = draw(st.integers(1, 3))
  inputs = tuple(draw(st.sampled_from(INPUT_SHAPES)) for _ in range(n_in))
  top_kind = draw(st.sampled_from(("ordered", "free", "plain")))
  # Half the programs use only ops whose bits don't depend on fusion.
  drawer = _Drawer(draw, sharded=sharded, futures=futures, budget=budget,
                   exact=draw(st.booleans()))
  vals = [_Val(s, 1.0, sharded) for s in inputs]
  body, outs = drawer.body(vals, depth=0, n_ops=budget)
  # The top block's outputs are the program's: arrays only, no literals
  # dropped into shard_map outputs without an axis.
  param = None
  if top_kind == "ordered":
    param = draw(st.sampled_from(STRICT))
  elif top_kind == "free":
    param = (tuple(i for i in range(n_in) if draw(st.booleans())),
             draw(st.booleans()))
  top = Block(top_kind, tuple(range(n_in)), tuple(body.records), outs, param)
  program = Program(inputs, top, sharded)
  if any(r.kind == "checkpoint" for r in walk(program)) and draw(st.booleans()):
    program = program._replace(remat3=True)
  return program


# --- building programs ----------------------------------------------------------------

def _mesh():
  if hasattr(jax.sharding, "AxisType"):
    return jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.make_mesh((2,), ("i",))


MESH = _mesh()
PERM = ((0, 1), (1, 0))


def identity_decorator(f=None, **_):
  """Stands in for `program_order`: the same body, no ordering at all."""
  return (lambda g: g) if f is None else f


class Ready(NamedTuple):
  """A finished collective in a future's place (a pytree, as futures are)."""
  value: Any

  def done(self):
    return self.value


# Each collective's arguments after (x, "i"), the same for jax.lax's and ours.
_COLLECTIVE_ARGS = {
    "psum": ((), {}),
    "all_gather": ((), dict(tiled=True)),
    "psum_scatter": ((), dict(tiled=True)),
    "all_to_all": ((0, 0), dict(tiled=True)),
    "ppermute": ((PERM,), {}),
}


def _collective(name, x, *, future):
  """`jax.lax.<name>` on axis "i", or our `<name>_start` (a future)."""
  extra, kwargs = _COLLECTIVE_ARGS[name]
  fn = getattr(jo, f"{name}_start") if future else getattr(lax, name)
  return fn(x, "i", *extra, **kwargs)
_UNARY_FN = {
    "sin": jnp.sin, "cos": jnp.cos, "tanh": jnp.tanh, "neg": jnp.negative,
    "abs": jnp.abs, "square": jnp.square, "half": lambda x: jnp.multiply(x, 0.5),
    "exp": jnp.exp, "logistic": jax.nn.sigmoid,
}
_BINARY_FN = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
              "max": jnp.maximum, "min": jnp.minimum}
_POLICY = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_only_a": jax.checkpoint_policies.save_only_these_names("a"),
    "default": None,
}


def _array_const(shape, seed):
  return (np.cos(np.arange(_size(shape), dtype=np.float32) * (seed + 1.3))
          .reshape(shape).astype(np.float32))


def _apply_op(op: Op, vals, futures: bool):
  kind, p = op.kind, op.param
  x = [vals[i] for i in op.args]
  if kind == "unary":
    return _UNARY_FN[p](x[0])
  if kind == "binary":
    return _BINARY_FN[p](x[0], x[1])
  if kind == "dot":
    return lax.dot_general(x[0], x[1], (((x[0].ndim - 1,), (0,)), ((), ())))
  if kind == "reduce":
    fn, axis = p
    return (jnp.sum if fn == "sum" else jnp.max)(x[0], axis=axis)
  if kind == "broadcast":
    shape = jnp.shape(x[0])
    if p == "front":
      return lax.broadcast_in_dim(x[0], (2, *shape), tuple(range(1, len(shape) + 1)))
    return lax.broadcast_in_dim(x[0], (*shape, 2), tuple(range(len(shape))))
  if kind == "reshape":
    return jnp.reshape(x[0], p)
  if kind == "slice":
    return lax.slice_in_dim(x[0], 0, jnp.shape(x[0])[0] // 2, axis=0)
  if kind == "where":
    return jnp.where(jnp.greater(x[0], 0.0), x[1], x[2])
  if kind == "iota":
    return lax.broadcasted_iota(jnp.float32, p, 0)
  if kind == "full":
    return jnp.full(p[0], p[1], jnp.float32)
  if kind == "scalar":
    return np.float32(p)
  if kind == "array":
    return _array_const(*p)
  if kind == "name":
    return checkpoint_name(x[0], p)
  if kind == "collective":
    return _collective(p, x[0], future=False)
  if kind == "start":
    if futures:
      return _collective(p, x[0], future=True)
    return Ready(_collective(p, x[0], future=False))
  if kind == "done":
    return x[0].done()
  raise ValueError(f"unknown op kind {kind!r}")


def _named_function(n: int, impl):
  """A function of parameters a0..a{n-1} (exclude_argnames needs names)."""
  params = [inspect.Parameter(f"a{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for i in range(n)]
  signature = inspect.Signature(params)

  def fn(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    return impl(*[bound.arguments[p.name] for p in params])
  fn.__signature__ = signature
  return fn


class _Builder:

  def __init__(self, po, futures):
    self.po = po
    self.futures = futures

  def run_body(self, records, outs, vals):
    vals = list(vals)
    for r in records:
      if isinstance(r, Block):
        vals.extend(self.call_block(r, vals))
      else:
        vals.append(_apply_op(r, vals, self.futures))
    return tuple(vals[i] for i in outs)

  def function(self, block: Block, records=None, outs=None):
    """`block`'s body as a Python function of its args (closure bound later)."""
    records = block.body if records is None else records
    outs = block.outs if outs is None else outs
    return lambda closed: (lambda *args: self.run_body(records, outs,
                                                       (*args, *closed)))

  def call_block(self, block: Block, vals):
    args = [vals[i] for i in block.args]
    closed = [vals[i] for i in block.closure]
    kind, p = block.kind, block.param
    body = self.function(block)(closed)
    if kind in ("ordered", "free", "plain"):
      fn = _named_function(len(args), body)
      keyword = False
      if kind == "ordered":
        fn = self.po(fn, enforce=True, strict_in_out=p)
      elif kind == "free":
        excluded, keyword = p
        names = tuple(f"a{i}" for i in excluded) or None
        fn = self.po(fn, enforce=False, exclude_argnames=names)
      if keyword:
        return fn(**{f"a{i}": a for i, a in enumerate(args)})
      return fn(*args)
    if kind == "jit":
      return jax.jit(body)(*args)
    if kind == "checkpoint":
      return jax.checkpoint(body, policy=_POLICY[p])(*args)
    if kind == "cond":
      pred = jnp.greater(jnp.sum(args[0]), 0.0)
      other = self.function(block, block.orelse, block.orelse_outs)(closed)
      return lax.cond(pred, body, other, *args[1:])
    if kind == "scan":
      n = len(args)

      def step(carry, _):
        outs = body(*carry)
        return tuple(outs[:n]), tuple(outs[n:])
      carry, ys = lax.scan(step, tuple(args), None, length=p)
      return (*carry, *ys)
    raise ValueError(f"unknown block kind {kind!r}")


def build(program: Program, *, po=jo.program_order, futures=True):
  """The program as a function of its inputs, returning a tuple of arrays.

  `po` decorates the ordered and free blocks (pass `identity_decorator` for
  none, or jax's own `program_order`); `futures=False` replaces each future
  by the synchronous `jax.lax` collective.
  """
  builder = _Builder(po, futures)
  top = functools.partial(builder.call_block, program.top)

  def per_device(*xs):
    outs = top(list(xs))
    return tuple(jnp.asarray(o) for o in outs)
  if not program.sharded:
    return per_device
  n_out = len(program.top.outs)

  def with_axis(*xs):   # every output gets a leading axis to split over "i"
    return tuple(o[None] for o in per_device(*xs))
  return jax.shard_map(with_axis, mesh=MESH,
                       in_specs=tuple(P("i") for _ in program.inputs),
                       out_specs=tuple(P("i") for _ in range(n_out)))


def inputs(program: Program, shift: float = 0.0):
  """Deterministic input values (global shapes when sharded) in [-1, 1]."""
  out = []
  for k, shape in enumerate(program.inputs):
    if program.sharded:
      shape = (2 * shape[0], *shape[1:])
    x = np.sin(np.arange(_size(shape), dtype=np.float32) * 0.7 + 0.3 * k + shift)
    x = jnp.asarray(x.reshape(shape).astype(np.float32))
    if program.sharded:
      x = jax.device_put(x, NamedSharding(MESH, P("i")))
    out.append(x)
  return out


# --- the contract, counted independently ---------------------------------------------

def _open(jaxpr):
  """The object with `eqns`, whichever form this jax passes around."""
  inner = getattr(jaxpr, "jaxpr", None)   # a ClosedJaxpr (jax < 0.11)
  return inner if isinstance(inner, core.Jaxpr) else jaxpr


def _is_literal(atom) -> bool:
  return isinstance(atom, core.Literal)


def _dce(jaxpr):
  """Dead code out, every output and input kept (jax's own DCE)."""
  j = _open(jaxpr)
  new, _ = pe.dce_jaxpr(j, [True] * len(j.outvars), instantiate=True)
  return new


def _is_ordered(eqn) -> bool:
  return eqn.primitive.name == "program_order" and eqn.params["enforce"]


def _is_free(eqn) -> bool:
  return eqn.primitive.name == "program_order" and not eqn.params["enforce"]


def _is_jit_call(eqn) -> bool:
  return eqn.primitive.name in ("pjit", "jit")


class Counts(NamedTuple):
  barriers: int
  tokens: int

  def __add__(self, other):
    return Counts(self.barriers + other.barriers, self.tokens + other.tokens)


def contract_counts(closed_jaxpr) -> Counts:
  """Barriers and tokens the lowered program holds, by docs/program-order.md's contract.

  Counted from the traced jaxpr, each nested jaxpr as many times as it is
  lowered inline (a jit called twice: twice). Besides the contract's
  barriers, those jax itself lowers: an `optimization_barrier` equation
  already in the program (jax_remat3 makes some) and one per differentiated
  `checkpoint` equation that prevents CSE.

  Dead code is found with jax's own DCE (`pe.dce_jaxpr`), as the contract's
  first rule says. The one fact taken from an equation's params is which
  inputs of a free block are excluded (`excluded`); jax's own program_order,
  the oracle on jax 0.12, checks those independently.
  """
  return _fold(_dce(closed_jaxpr), _ordered_body, _jax_own_barriers)


def literal_fed_steps(closed_jaxpr) -> int:
  """Steps of ordered bodies whose B has inputs, all literals (B not a jit
  call or free block): the contract ties B to a token as if it had no input
  at all; jax's own program_order ties a token only for B without inputs."""
  def rule(body, strict_in, strict_out):
    del strict_in, strict_out
    n = sum(1 for prev, eqn in _steps(body)
            if eqn.invars and all(map(_is_literal, eqn.invars))
            and not _is_free(eqn) and not _is_jit_call(eqn))
    return Counts(0, n)
  return _fold(_dce(closed_jaxpr), rule, lambda eqn: Counts(0, 0)).tokens


def _fold(jaxpr, body_rule, own_rule) -> Counts:
  """Sums `body_rule(body, strict_in, strict_out)` over the ordered bodies
  and `own_rule(eqn)` over the other equations, nested ones included."""
  total = Counts(0, 0)
  j = _open(jaxpr)
  used = _used_later(j)
  for k, eqn in enumerate(j.eqns):
    if eqn.primitive.name == "program_order":
      body = _dce(eqn.params["call_jaxpr"])
      total += _fold(body, body_rule, own_rule)
      if eqn.params["enforce"]:
        total += body_rule(body, eqn.params["strict_in"],
                           eqn.params["strict_out"])
      continue
    total += own_rule(eqn)
    for sub in _inner_jaxprs(eqn, [v in used[k] for v in eqn.outvars]):
      total += _fold(sub, body_rule, own_rule)
  return total


def _used_later(jaxpr) -> list[set]:
  """For each equation, the variables read after it (or returned)."""
  live = set(v for v in jaxpr.outvars if not _is_literal(v))
  out = []
  for eqn in reversed(jaxpr.eqns):
    out.append(set(live))
    live |= set(v for v in eqn.invars if not _is_literal(v))
  return out[::-1]


def _jax_own_barriers(eqn) -> Counts:
  name = eqn.primitive.name
  if name == "optimization_barrier":
    return Counts(1, 0)
  if name in ("checkpoint", "remat", "remat2"):
    cse = eqn.params.get("prevent_cse", False)
    cse = any(cse) if isinstance(cse, tuple) else bool(cse)
    if eqn.params.get("differentiated", False) and cse:
      return Counts(1, 0)
  return Counts(0, 0)


def _inner_jaxprs(eqn, used_outs):
  """The jaxprs an equation lowers inline, each once."""
  yield from core.jaxprs_in_params(eqn.params)
  # jax 0.12's HiJAX calls (jax_remat3's checkpoint) keep theirs on the
  # object they call, which jax's DCE does not enter: its dead code (here,
  # what feeds only unused outputs) is taken out as the lowering does.
  called = eqn.params.get("_prim")
  if called is not None:
    for sub in core.jaxprs_in_params(getattr(called, "params", {})):
      inner = _open(sub)
      if len(inner.outvars) == len(used_outs):
        sub, _ = pe.dce_jaxpr(inner, list(used_outs), instantiate=True)
      yield sub


def _steps(body):
  """(A, B) for each pair of consecutive equations of a body."""
  eqns = _open(body).eqns
  return zip(eqns, eqns[1:])


def _ordered_body(body, strict_in: bool, strict_out: bool) -> Counts:
  """docs/program-order.md's rules, between each pair of consecutive equations."""
  body = _open(body)
  barriers = tokens = 0
  if strict_in and body.invars:
    barriers += 1          # one barrier over all inputs first
  for prev, eqn in _steps(body):
    fed = [v for v in eqn.invars if not _is_literal(v)]
    if not fed:
      # No non-literal input (an iota, a constant): a token tied to A's
      # outputs, and B called on it.
      barriers += 1
      tokens += 1
    elif _is_free(eqn) or _is_jit_call(eqn):
      excluded = eqn.params["excluded"] if _is_free(eqn) else \
          (False,) * len(eqn.invars)
      made_by_a = set(prev.outvars)
      waiting = [v for v, ex in zip(eqn.invars, excluded)
                 if not _is_literal(v) and not ex]
      if waiting:
        # A token tied to A's outputs; each input A did not make waits
        # for it in a barrier of its own. (Nothing at all where every
        # non-literal input is excluded: no input waits.)
        barriers += 1 + sum(v not in made_by_a for v in waiting)
        tokens += 1
    else:
      barriers += 1        # A's unconsumed outputs with B's inputs
  if strict_out and body.outvars:
    barriers += 1          # one barrier over all outputs last (literals too)
  return Counts(barriers, tokens)


# --- counting in lowered text -------------------------------------------------------

_NAME = r'(@[\w.$-]+|@"[^"]+")'
_FUNC = re.compile(r"^  func\.func (?:public |private )?" + _NAME, re.M)
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call " + _NAME)


def stablehlo_counts(text: str) -> Counts:
  """`optimization_barrier` and `create_token` ops in StableHLO text, each
  function counted once per call, as if every call were inlined."""
  starts = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)]
  funcs = {}
  for k, (pos, name) in enumerate(starts):
    end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
    funcs[name] = text[pos:end]

  @functools.cache
  def inlined(name) -> Counts:
    src = funcs[name]
    own = Counts(src.count("stablehlo.optimization_barrier"),
                 src.count("stablehlo.create_token"))
    for callee in _CALL.findall(src):
      own += inlined(callee)
    return own
  return inlined("@main")
