"""The order of `fsdp_scan`'s layer arguments: the parameters first.

Every pattern calls the user's function with its parameters first:
`pipeline_loss` calls `stage_fn(params, x)`, `expert_parallel`
`expert_fn(params, tokens)`, as flax calls `apply(params, x)`. `fsdp_scan`
called `layer(x, params)`. `fsdp_scan(..., params_first=True)` calls
`layer(params, x)` (`layer(params, x, xs_i)` with `xs=`); the old order stays
the default for now, with a `LayerArgumentOrderWarning` at the user's call.

Why a switch and not a guess: a square weight and an activation of the same
shape fit either order, so a call cannot be told apart by its types, and a
wrong guess would be a silent wrong answer.

Pinned by tests/patterns/fsdp/argument_order_test.py.
"""

from __future__ import annotations

import warnings
from typing import Callable


class LayerArgumentOrderWarning(DeprecationWarning):
  """`fsdp_scan` was called without `params_first=True`: its layer takes
  `(x, params)`, the one order no other pattern uses.

  Example:
    >>> import warnings
    >>> from jax_overlap import errors
    >>> warnings.filterwarnings(
    ...     "error", category=errors.LayerArgumentOrderWarning)
  """


MESSAGE = (
    "fsdp_scan: layer(x, params) is deprecated; every pattern calls "
    "fn(params, x) (pipeline_loss, expert_parallel). Write layer(params, x) "
    "and pass params_first=True; the default becomes True in a later release.")


def warn_params_last(stacklevel: int) -> None:
  """Warns that the layer takes `(x, params)`; `stacklevel` counts from the
  caller of this function (2: that caller's caller)."""
  warnings.warn(MESSAGE, LayerArgumentOrderWarning, stacklevel=stacklevel + 1)


def x_first(layer: Callable) -> Callable:
  """`layer(params, x, *rest)` as `fsdp_scan`'s executor calls a layer:
  `f(x, params, *rest)`."""
  return lambda x, params, *rest: layer(params, x, *rest)


def layer_call(params_first: bool, xs: bool = False) -> str:
  """How the user's layer is called, for error messages."""
  args = ["params[i]", "x"] if params_first else ["x", "params[i]"]
  return f"layer({', '.join(args + (['xs[i]'] if xs else []))})"
