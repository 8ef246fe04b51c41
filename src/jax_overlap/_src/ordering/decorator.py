"""`program_order`: the decorator users write."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Sequence

import jax

from jax_overlap._src import _compat
from jax_overlap._src.ordering import rules as _rules  # noqa: F401 - registers rules
from jax_overlap._src.ordering.primitive import bind
from jax_overlap._src.xla import ordered_blocks as _ordered_blocks  # noqa: F401 - registers rules

_REQUIRED = object()


def program_order(f: Callable | None = None, *, enforce: bool = _REQUIRED,  # type: ignore[assignment]
                  strict_in_out: bool | tuple[bool, bool] = False,
                  exclude_argnames: str | Sequence[str] | None = None):
  """Makes XLA keep the operations of ``f`` in the order they were written.

  With ``enforce=True`` each operation of ``f`` is fenced to the one before it
  when the program is lowered, so the compiler may not hoist, sink or
  interleave them. A nested ``program_order(enforce=False)`` block is one
  step of its ordered parent whose own inside may be reordered freely: the
  place to put a collective and the compute it should hide behind.

  The traced program holds a single ``program_order`` equation and no
  barrier, so ``jax.grad``, ``jax.checkpoint`` and ``jax.vmap`` see the same
  program as without the decorator, and save the same residuals.

  Args:
    f: the function to order. Leave it out to use ``program_order`` as a
      decorator factory.
    enforce: required. True to keep the written order; False for a free block
      inside an ordered one.
    strict_in_out: True (or a pair ``(strict_in, strict_out)``) to also fence
      all inputs before the first operation and all outputs after the last.
      Only with ``enforce=True``.
    exclude_argnames: names of parameters of a free block that the enclosing
      ordered block must not tie to the previous step (for example a weight
      that is ready long before). Only with ``enforce=False``.

  Returns:
    ``f`` wrapped, or a decorator when ``f`` is None. Arguments and results
    may be any pytrees; keyword arguments work.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax_overlap import program_order
    >>> @jax.jit
    ... @program_order(enforce=True)
    ... def f(x, y):
    ...   return jnp.sin(x), jnp.cos(y)
    >>> a, b = f(jnp.zeros(3), jnp.zeros(3))
    >>> print(b)
    [1. 1. 1.]
  """
  if enforce is _REQUIRED:
    raise TypeError(
        "program_order() requires the keyword argument `enforce`: "
        "enforce=True to keep the written order, enforce=False for a free "
        "block nested in an ordered one.")
  if not isinstance(enforce, bool):
    raise TypeError(
        f"program_order(enforce=...) must be True or False, got {enforce!r}.")
  strict_in, strict_out = _parse_strict(strict_in_out)
  if enforce and exclude_argnames is not None:
    raise ValueError(
        "exclude_argnames cannot be used with enforce=True: an ordered block "
        f"fences every input (got exclude_argnames={exclude_argnames!r}). Put "
        "the excluded arguments on a nested program_order(enforce=False) block.")
  if not enforce and (strict_in or strict_out):
    raise ValueError(
        "strict_in_out=True cannot be used with enforce=False: a free block "
        f"orders nothing (got strict_in_out={strict_in_out!r}). Use it on the "
        "enclosing program_order(enforce=True) block.")
  names = _parse_names(exclude_argnames)

  def decorate(fun: Callable) -> Callable:
    if not callable(fun):
      raise TypeError(f"program_order expects a function, got {fun!r}.")
    if names:
      _check_names(fun, names)
    return _wrap(fun, enforce=enforce, strict_in=strict_in,
                 strict_out=strict_out, excluded_names=names)

  return decorate if f is None else decorate(f)


def _parse_strict(strict_in_out) -> tuple[bool, bool]:
  if isinstance(strict_in_out, bool):
    return strict_in_out, strict_in_out
  if (isinstance(strict_in_out, (tuple, list)) and len(strict_in_out) == 2
      and all(isinstance(s, bool) for s in strict_in_out)):
    return bool(strict_in_out[0]), bool(strict_in_out[1])
  raise TypeError(
      "program_order(strict_in_out=...) must be a bool or a pair of bools "
      f"(strict_in, strict_out), got {strict_in_out!r}.")


def _parse_names(exclude_argnames) -> tuple[str, ...]:
  if exclude_argnames is None:
    return ()
  if isinstance(exclude_argnames, str):
    return (exclude_argnames,)
  try:
    names = tuple(exclude_argnames)
  except TypeError:
    names = (exclude_argnames,)
  if not all(isinstance(n, str) for n in names):
    raise TypeError(
        "program_order(exclude_argnames=...) must be a parameter name or a "
        f"sequence of names, got {exclude_argnames!r}.")
  return names


def _check_names(fun, names):
  params = inspect.signature(fun).parameters
  unknown = [n for n in names if n not in params]
  if unknown:
    raise ValueError(
        f"program_order(exclude_argnames=...) names {unknown} but "
        f"{getattr(fun, '__qualname__', fun)} has no such parameter; its "
        f"parameters are {list(params)}.")


def _wrap(fun, *, enforce, strict_in, strict_out, excluded_names):
  # One jit object per decorated function: jax caches its traces, so calling
  # twice with the same shapes traces once.
  jitted = jax.jit(fun)
  signature = inspect.signature(fun) if excluded_names else None

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    try:
      traced = jitted.trace(*args, **kwargs)
    except TypeError as e:
      if "static_argnums" in str(e) or isinstance(
          e, jax.errors.ConcretizationTypeError):
        e.add_note(
            "program_order traces its function as jax.jit does: every argument "
            "is an array. Bind a value the body needs at trace time (a shape, "
            "a flag) before decorating, e.g. "
            "program_order(functools.partial(f, n=3), enforce=True), instead "
            "of passing it as an argument.")
      raise
    args_flat = jax.tree_util.tree_leaves((args, kwargs))
    closed_over = list(getattr(traced, "_consts", ()))
    if excluded_names:
      arg_mask = _excluded_leaves(signature, excluded_names, args, kwargs)
    else:
      arg_mask = [False] * len(args_flat)
    inputs = [*closed_over, *args_flat]
    excluded = [False] * len(closed_over) + arg_mask
    body, used = _used_inputs(traced.jaxpr)
    outs = bind([x for x, u in zip(inputs, used) if u], call_jaxpr=body,
                enforce=enforce, strict_in=strict_in, strict_out=strict_out,
                excluded=[e for e, u in zip(excluded, used) if u])
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)

  return wrapped


def _used_inputs(closed):
  """The body, and which of its inputs it reads.

  An input the body never reads must not be an input of the equation:
  autodiff would take the block to depend on it and keep what its tangent
  needs (e.g. jax.checkpoint around the block saves a residual the
  undecorated function doesn't). Where every input is read, the body is
  returned unchanged.
  """
  n_out = len(_compat.open_jaxpr(closed).outvars)
  body, used = _compat.dce(closed, [True] * n_out)
  return (closed, used) if all(used) else (body, used)


def _excluded_leaves(signature, names, args, kwargs) -> list[bool]:
  """One bool per leaf of (args, kwargs): does it belong to an excluded name?"""
  signature.bind(*args, **kwargs)  # a call that doesn't fit fails here, clearly
  positional = [p for p in signature.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  var_pos = next((p.name for p in signature.parameters.values()
                  if p.kind is p.VAR_POSITIONAL), None)
  var_kw = next((p.name for p in signature.parameters.values()
                 if p.kind is p.VAR_KEYWORD), None)
  arg_names = [positional[i].name if i < len(positional) else var_pos
               for i in range(len(args))]
  kw_names = {k: (k if k in signature.parameters else var_kw) for k in kwargs}
  mark = lambda tree, name: jax.tree_util.tree_map(lambda _: name in names, tree)
  mask_tree = (tuple(mark(a, n) for a, n in zip(args, arg_names)),
               {k: mark(v, kw_names[k]) for k, v in kwargs.items()})
  return jax.tree_util.tree_leaves(mask_tree)
