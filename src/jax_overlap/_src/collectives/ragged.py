"""The ragged all-to-all: its argument checks, and its form for XLA:CPU.

XLA:CPU cannot run `ragged-all-to-all` (on every supported jax:
"UNIMPLEMENTED: HLO opcode ragged-all-to-all is not supported by XLA:CPU
ThunkEmitter"), so a future lowered for CPU runs `by_dense_all_to_all`: every
chunk padded to the worst case (`min(N, M)` rows), one dense all-to-all of
the chunks and of the output offsets, and gathers by the offsets on each
side. Same values as `jax.lax.ragged_all_to_all` (gathers and selects only:
no sums), `K` times the bytes of the operand in flight. GPU and TPU get the
real ragged all-to-all.

The future carries `operand` and `output` as one differentiable buffer,
stacked along rows (`operand` first), and the four integer arrays beside it
(`Comm.jaxpr`'s `aux`); its value is the ragged all-to-all of the two halves.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

_INT_ARGS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def check_arguments(operand, output, ints, group_size: int | None):
  """Raises a clear error (naming the argument) for arguments that
  `jax.lax.ragged_all_to_all` cannot take; `ints` are the four integer
  arrays in signature order."""
  where = "ragged_all_to_all_start"
  if operand.ndim == 0:
    raise ValueError(f"{where}(operand=...): operand must have at least one "
                     "dimension (the rows that are sent); got a scalar.")
  if output.ndim != operand.ndim or output.shape[1:] != operand.shape[1:]:
    raise ValueError(
        f"{where}(output=...): output's shape {tuple(output.shape)} must be "
        f"operand's {tuple(operand.shape)} but for its first dimension "
        "(rows are sent whole).")
  if output.dtype != operand.dtype:
    raise TypeError(
        f"{where}(output=...): output's dtype {output.dtype} must be "
        f"operand's ({operand.dtype}); cast one of them.")
  for name, a in zip(_INT_ARGS, ints):
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise TypeError(
          f"{where}({name}=...): {name} must be an integer array; got dtype "
          f"{a.dtype}.")
    if a.ndim != 1 or a.shape[0] < 1:
      raise ValueError(
          f"{where}({name}=...): {name} must be a non-empty 1-D array "
          f"(one entry a chunk); got shape {tuple(a.shape)}.")
  lengths = {name: a.shape[0] for name, a in zip(_INT_ARGS, ints)}
  if len(set(lengths.values())) != 1:
    raise ValueError(
        f"{where}: input_offsets, send_sizes, output_offsets and recv_sizes "
        f"must have one length (one entry a chunk); got {lengths}.")
  k = ints[0].shape[0]
  if group_size is not None and k % group_size:
    raise ValueError(
        f"{where}(input_offsets=...): the number of chunks ({k}) must be a "
        f"multiple of the number of devices exchanging ({group_size}): chunk "
        f"i goes to device i // (chunks per device).")


def group_size(axis_name, axis_index_groups) -> int | None:
  if axis_index_groups is not None:
    return len(axis_index_groups[0])
  try:
    return lax.axis_size(axis_name)
  except Exception:  # noqa: BLE001 - not a bound axis: jax says so later
    return None


def by_real_op(n_rows, axis_name, axis_index_groups):
  """stacked, *ints -> `jax.lax.ragged_all_to_all` of the two halves."""
  def fn(stacked, *ints):
    return lax.ragged_all_to_all(
        stacked[:n_rows], stacked[n_rows:], *ints, axis_name=axis_name,
        axis_index_groups=axis_index_groups)
  return fn


def by_dense_all_to_all(n_rows, axis_name, axis_index_groups):
  """stacked, *ints -> the same value, by ops XLA:CPU runs (module doc)."""
  def fn(stacked, input_offsets, send_sizes, output_offsets, recv_sizes):
    operand, output = stacked[:n_rows], stacked[n_rows:]
    n, m = operand.shape[0], output.shape[0]
    k = input_offsets.shape[0]
    size = group_size(axis_name, axis_index_groups)
    per = k // size
    rows = min(n, m)            # the most rows a chunk can hold
    r = jnp.arange(rows)
    trailing = (1,) * (operand.ndim - 1)

    # Sender: chunk i = operand[input_offsets[i] : + send_sizes[i]], padded.
    src = input_offsets[:, None].astype(jnp.int32) + r[None, :]
    sent = r[None, :] < send_sizes[:, None]
    chunks = operand[jnp.clip(src, 0, n - 1)]                 # (k, rows, ...)
    chunks = jnp.where(sent.reshape(*sent.shape, *trailing), chunks, 0)
    exchanged = lax.all_to_all(
        chunks.reshape(size, per, *chunks.shape[1:]), axis_name, 0, 0,
        axis_index_groups=axis_index_groups)
    received = exchanged.reshape(k * rows, *chunks.shape[2:])  # slot i, row j
    # Where this device's received slot i starts in its output.
    starts = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True,
                            axis_index_groups=axis_index_groups)

    # Receiver: output row t takes row t - starts[i] of the slot i that
    # covers it (the last such slot, should two overlap), else keeps output.
    t = jnp.arange(m)
    offset = t[None, :] - starts[:, None].astype(jnp.int32)    # (k, m)
    covers = (offset >= 0) & (offset < recv_sizes[:, None])
    slot = (k - 1) - jnp.argmax(covers[::-1], axis=0)          # (m,)
    written = jnp.any(covers, axis=0)
    row = jnp.take_along_axis(offset, slot[None, :], axis=0)[0]
    flat = jnp.clip(slot * rows + row, 0, k * rows - 1)
    took = received[flat]
    return jnp.where(written.reshape(m, *trailing), took, output)
  return fn

