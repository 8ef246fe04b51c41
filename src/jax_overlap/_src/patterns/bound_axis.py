"""The size of the one mesh axis a pattern runs over, or an error naming it.

Invariant: a pattern given a tuple of axes, or a name no enclosing
`shard_map` binds, raises at its call with the argument and the fix, not
jax's unbound-axis error from deep inside. Pinned by
tests/patterns/moe/moe_test.py and tests/patterns/attention/attention_misuse_test.py.
"""

from __future__ import annotations

import jax


def one_axis_size(name: str, axis, *, several: str, bound_hint: str = "",
                  arg: str = "axis") -> int:
  """`jax.lax.axis_size(axis)` for one bound axis name, called by `name`
  with the argument `arg`.

  `several`: the sentence saying why several axes are refused;
  `bound_hint`: what else the enclosing shard_map must do (", with ...")."""
  if isinstance(axis, (tuple, list, set, frozenset)):
    raise TypeError(f"{name}({arg}={axis!r}): give one mesh axis name; {several}")
  try:
    return int(jax.lax.axis_size(axis))
  except NameError:
    raise NameError(
        f"{name}({arg}={axis!r}): no mesh axis named {axis!r} is bound here. "
        f"Call it inside jax.shard_map over a mesh that has this axis"
        f"{bound_hint}.") from None
