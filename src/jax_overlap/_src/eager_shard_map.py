"""Primitives that run whole inside an eager `jax.shard_map`.

An eager shard_map (one not under `jax.jit`) compiles and runs each primitive
of its body on its own. A collective start compiled alone would have its done
in another program, and an ordered block compiled alone could not hand a
started future to the code after it. So in an eager shard_map our primitives
are evaluated right away, on the shard_map's own values: a start runs its
collective to the end (the done then hands the value over), and a
`program_order` block runs its body one primitive at a time, which is the
written order. Everywhere else (jit, autodiff, vmap, eager calls outside
shard_map) they bind as usual.
"""

from __future__ import annotations

from typing import Any, Callable

from jax._src import core
from jax._src.shard_map import ShardMapTrace


class EagerAwarePrimitive(core.Primitive):
  """A primitive with its own evaluation for eager shard_map bodies."""

  def __init__(self, name: str):
    super().__init__(name)
    self.eager_rule: Callable[..., Any] | None = None

  def def_eager_shard_map(self, rule: Callable[..., Any]) -> Callable[..., Any]:
    """`rule(*args, **params)` runs with the eager shard_map as current trace."""
    self.eager_rule = rule
    return rule

  def bind_with_trace(self, trace, args, avals, params, /):
    if self.eager_rule is not None and isinstance(trace, ShardMapTrace):
      with core.set_current_trace(trace):
        return self.eager_rule(*args, **params)
    return super().bind_with_trace(trace, args, avals, params)
