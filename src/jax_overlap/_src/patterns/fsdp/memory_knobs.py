"""`fsdp_scan(reshard_after_forward=..., prefetch=...)`: what the user gave,
checked at the call and read as two numbers.

* `reshard_after_forward` says how many of the last layers keep their
  gathered weights from the forward pass to the backward pass (the backward
  pass runs them first, so it would otherwise wait for their regathers):
  True keeps none (every layer is regathered, the least memory), False keeps
  all of them (no regather at all), an int k the last k. The default, 1,
  keeps the last layer: measured on the demo's step it hides the backward
  pass's first regather at no cost in H100 temp bytes (docs/fsdp.md).
* `prefetch` says how many layers ahead of its use a gather is started.
"""

from __future__ import annotations

import numbers

import numpy as np


def kept_layers(reshard_after_forward, n_layers: int) -> int:
  """How many of the last layers keep their gathered weights (0 to n)."""
  if reshard_after_forward is True:
    return 0
  if reshard_after_forward is False:
    return n_layers
  value = reshard_after_forward
  if isinstance(value, np.bool_) or not isinstance(value, numbers.Integral) \
      or not 0 <= value <= n_layers:
    raise ValueError(
        f"fsdp_scan(reshard_after_forward=...) must be True (regather every "
        f"layer in the backward pass), False (keep every gathered layer) or "
        f"an int from 0 to the number of layers ({n_layers} here): how many "
        f"of the last layers keep their gathered weights; got {value!r}.")
  return int(value)


def prefetch_depth(prefetch, n_layers: int) -> int:
  """How many layers ahead a gather starts (at least 1; more than the layers
  there are to gather is the same as all of them)."""
  if isinstance(prefetch, (bool, np.bool_)) \
      or not isinstance(prefetch, numbers.Integral) or prefetch < 1:
    raise ValueError(
        f"fsdp_scan(prefetch=...) must be an int >= 1, how many layers ahead "
        f"of its use each weight gather starts (1: the next layer's gather "
        f"runs behind this layer; each more holds one more gathered layer); "
        f"got {prefetch!r}.")
  return max(1, min(int(prefetch), n_layers - 1))
