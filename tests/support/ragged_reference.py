"""A reference for jax.lax.ragged_all_to_all that XLA:CPU runs, for tests.

XLA:CPU cannot run jax's own op. This one gathers every device's operand and
tables and picks each written row by masks: built apart from the library's
CPU form (a dense all-to-all of padded chunks), and checked against the
documented send/receive loop in numpy (ragged_all_to_all_test.py).
"""

import jax.numpy as jnp
from jax import lax


def dense_reference(operand, output, in_off, send, out_off, axis):
  """jax.lax.ragged_all_to_all's value on this device, by gathering every
  device's operand and tables: row t of the output is written by the chunk
  of some device d addressed here whose rows cover t."""
  size = lax.axis_size(axis)
  me = lax.axis_index(axis)
  ops = lax.all_gather(operand, axis)                   # (size, N, ...)
  ios, sss, oos = (lax.all_gather(a, axis) for a in (in_off, send, out_off))
  per = in_off.shape[0] // size
  t = jnp.arange(output.shape[0])
  result = output
  for d in range(size):
    for p in range(per):
      i = me * per + p
      rel = t - oos[d, i]
      hit = (rel >= 0) & (rel < sss[d, i])
      rows = ops[d][jnp.clip(ios[d, i] + rel, 0, operand.shape[0] - 1)]
      result = jnp.where(hit[:, None], rows, result)
  return result
