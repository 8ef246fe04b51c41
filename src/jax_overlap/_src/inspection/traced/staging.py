"""Which function `inspect` and `measure` take, and how each is traced,
lowered and run without wrapping a jitted one again.

A function that is already jitted keeps its own jit: `jax.jit`, `nnx.jit`
(whose `trace(...)` gives a flax `Traced` holding jax's in `.traced`) and
`eqx.filter_jit` (which has `lower` but no `trace`, and holds the module's
non-array leaves, such as an activation function, static). Wrapping those
in `jax.jit` again would trace every argument and fail on the non-array
leaves. Only a plain function is wrapped in `jax.jit`; where that fails on
an argument that is not an array, the error names the argument and what to
pass instead. Pinned by tests/integration/real_clients_report_test.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import numpy as np

_ACCEPTED = (
    "a jitted function (jax.jit, flax nnx.jit, equinox eqx.filter_jit: "
    "anything with .trace or .lower) or a plain function of arrays")


@dataclasses.dataclass
class Staged:
  """`fn` at its example arguments: the traced program (`jaxpr`, None when
  `fn` only lowers and could not be traced here), a way to get jax's
  `Lowered` of `fn`'s own jit, and notes on what was chosen."""

  name: str
  jaxpr: Any | None
  lower: Callable[[], jax.stages.Lowered]
  notes: list[str]


def runnable(fn, caller: str):
  """`fn` itself when it is jitted (has `.lower`), else `jax.jit(fn)`."""
  if not callable(fn):
    raise TypeError(f"{caller}(fn=...) must be a function: {_ACCEPTED}; "
                    f"got {fn!r}.")
  return fn if hasattr(fn, "lower") else jax.jit(fn)


@contextlib.contextmanager
def argument_errors(fn, args, kwargs, caller: str):
  """Where `jax.jit(fn)` (a plain `fn`) fails with a TypeError and an
  argument leaf is not an array, raises a TypeError naming that argument,
  what it is and what to pass instead; any other error passes unchanged."""
  try:
    yield
  except TypeError as e:
    if hasattr(fn, "lower"):
      raise
    bad = _non_array_argument(args, kwargs)
    if bad is None:
      raise
    where, leaf = bad
    text = repr(leaf)
    text = text if len(text) <= 80 else text[:77] + "..."
    raise TypeError(
        f"{caller}(fn)(*args): {where} is a {type(leaf).__name__} ({text}), "
        f"not an array, and fn={getattr(fn, '__name__', fn)!r} is not "
        f"jitted, so {caller} wrapped it in jax.jit, which traces every "
        "argument. Pass fn jitted with that argument held static: "
        "eqx.filter_jit(fn) for an equinox module, nnx.jit(fn) for a flax "
        "nnx one, or jax.jit(fn, static_argnums=...); overlap_report and "
        "measure take any jitted function with .trace or .lower as it is.") from e


def stage(fn, args, kwargs, caller: str) -> Staged:
  """Traces `fn` at `args`, keeping its own jit (see the module docstring)."""
  jitted = runnable(fn, caller)
  name = getattr(fn, "__name__", None) or type(fn).__name__
  if hasattr(jitted, "trace"):
    with argument_errors(fn, args, kwargs, caller):
      traced = jitted.trace(*args, **kwargs)
    jaxpr = traced_jaxpr(traced)
    notes = [] if jaxpr is not None else [
        f"{name}.trace(...) gave a {type(traced).__name__} holding no "
        "jaxpr: only the compiled schedule is reported."]
    return Staged(name, jaxpr, lambda: jax_lowered(traced.lower()), notes)
  # Lowers only (eqx.filter_jit): its own lowering is what compiles; the
  # traced program comes from calling it with its array leaves traced and
  # every other leaf held as given, as its own jit holds them.
  jaxpr, notes = _jaxpr_holding_non_arrays(jitted, args, kwargs, name)
  return Staged(name, jaxpr,
                lambda: jax_lowered(jitted.lower(*args, **kwargs)), notes)


def traced_jaxpr(traced) -> Any | None:
  """The jaxpr of jax's `Traced`, or of a wrapper holding one in `.traced`
  (flax nnx's)."""
  for _ in range(4):
    if traced is None:
      return None
    jaxpr = getattr(traced, "jaxpr", None)
    if jaxpr is not None:
      return jaxpr
    traced = getattr(traced, "traced", None)
  return None


def jax_lowered(lowered):
  """jax's `Lowered` inside a wrapper's (nnx and equinox hold it in
  `.lowered`); the object itself when it is one or holds none."""
  return _unwrap(lowered, jax.stages.Lowered, "lowered")


def jax_compiled(compiled):
  """jax's `Compiled` inside a wrapper's (`.compiled`), as `jax_lowered`."""
  return _unwrap(compiled, jax.stages.Compiled, "compiled")


def _unwrap(obj, cls, attr: str):
  inner = obj
  for _ in range(4):
    if isinstance(inner, cls):
      return inner
    inner = getattr(inner, attr, None)
    if inner is None:
      break
  return obj


def is_array(leaf) -> bool:
  """An argument leaf that jit traces as an array: a jax or NumPy array, a
  `jax.ShapeDtypeStruct`, anything with a shape and a dtype."""
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic,
                           jax.ShapeDtypeStruct)) or (
      hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _non_array_argument(args, kwargs):
  """(name, leaf) of the first argument leaf jit cannot trace, or None."""
  paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
  for path, leaf in paths:
    if not (is_array(leaf) or hasattr(leaf, "__jax_array__")
            or isinstance(leaf, (bool, int, float, complex))):
      return _argument_name(path), leaf
  return None


def _argument_name(path) -> str:
  """'args[0].activation' for the path of a leaf of `(args, kwargs)`."""
  if not path:
    return "an argument"
  head, *rest = path
  index = getattr(head, "idx", None)
  first = "args" if index == 0 else "kwargs"
  return first + jax.tree_util.keystr(tuple(rest))


def _jaxpr_holding_non_arrays(jitted, args, kwargs, name):
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  dynamic = [k for k, leaf in enumerate(leaves) if is_array(leaf)]

  def call(*values):
    full = list(leaves)
    for k, v in zip(dynamic, values):
      full[k] = v
    a, kw = jax.tree_util.tree_unflatten(tree, full)
    return jitted(*a, **kw)

  try:
    traced = jax.jit(call).trace(*[leaves[k] for k in dynamic])
  except Exception as e:  # noqa: BLE001 - any failure: compiled schedule only
    return None, [
        f"{name} has .lower but no .trace, and tracing it here with its "
        f"non-array arguments held failed ({type(e).__name__}: "
        f"{str(e).splitlines()[0][:200] if str(e) else ''}): only the "
        "compiled schedule is reported."]
  return traced.jaxpr, []
