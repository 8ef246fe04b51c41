"""Which chunks of the global sequence each device of the ring holds.

* "contiguous": the sequence in p chunks, device d holds chunk d (what
  sharding the sequence dimension over the axis gives).
* "zigzag": the sequence in 2p chunks, device d holds chunks d and
  2p - 1 - d, in that order. Under a causal mask every device then has
  the same number of unmasked (query chunk, key chunk) pairs
  (plan.py; tests/patterns/attention/attention_layout_test.py).

`to_layout` reorders a global sequence so that sharding it contiguously
over the axis gives each device its chunks; `from_layout` undoes it.
"""

from __future__ import annotations

import jax
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(name: str, layout) -> str:
  if layout not in LAYOUTS:
    raise ValueError(
        f"{name}(layout={layout!r}): unknown layout; give one of "
        f"{', '.join(map(repr, LAYOUTS))}.")
  return layout


def chunks_per_device(layout: str) -> int:
  return 2 if layout == "zigzag" else 1


def device_chunks(layout: str, axis_size: int, device: int) -> tuple[int, ...]:
  """The global chunk indices device `device` holds, in its local order
  (chunks of seq / (axis_size * chunks_per_device(layout)))."""
  if layout == "zigzag":
    return (device, 2 * axis_size - 1 - device)
  return (device,)


def _order(layout: str, axis_size: int) -> np.ndarray:
  """Global chunk index at each position of the laid-out sequence."""
  return np.array([c for d in range(axis_size)
                   for c in device_chunks(layout, axis_size, d)])


def _reorder(name, x, layout, axis_size, seq_axis, inverse):
  check_layout(name, layout)
  if not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
    raise ValueError(f"{name}(axis_size={axis_size!r}) must be a positive int.")
  seq_axis = int(seq_axis) % x.ndim
  n = axis_size * chunks_per_device(layout)
  length = x.shape[seq_axis]
  if length % n:
    raise ValueError(
        f"{name}: the sequence (axis {seq_axis} of shape {tuple(x.shape)}) "
        f"has length {length}, which layout {layout!r} cannot split into "
        f"{n} equal chunks for {axis_size} devices; make it a multiple of {n}.")
  if layout == "contiguous":
    return x
  order = _order(layout, axis_size)
  if inverse:
    order = np.argsort(order)
  shape = x.shape
  chunked = x.reshape(*shape[:seq_axis], n, length // n, *shape[seq_axis + 1:])
  return _gather(chunked, (slice(None),) * seq_axis + (order,)).reshape(shape)


def _gather(x, index):
  """`x[index]`, typed as sharded like `x`: over a mesh's Explicit axes jax
  cannot choose a gather's output sharding itself (ShardingTypeError), and
  the chunks stay sharded where they were
  (tests/patterns/attention/attention_layout_test.py::test_layout_of_an_array_on_a_mesh)."""
  if isinstance(x, np.ndarray):
    return x[index]
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", ())
  if any(name is not None for name in spec):
    return x.at[index].get(out_sharding=sharding)
  return x[index]


def to_layout(x, layout: str, axis_size: int, seq_axis: int = 1):
  """Reorders a global sequence for `ring_attention(layout=layout)`.

  Sharding the result's `seq_axis` contiguously over `axis_size` devices
  gives each device the chunks `layout` says it holds.

  Args:
    x: an array holding the whole sequence along `seq_axis`.
    layout: "contiguous" (returns `x`) or "zigzag".
    axis_size: the number of devices the sequence is sharded over.
    seq_axis: the sequence dimension of `x`.

  Returns:
    `x` with its sequence chunks reordered; `from_layout` undoes it.

  Example:
    >>> import jax.numpy as jnp
    >>> import jax_overlap
    >>> jax_overlap.to_layout(jnp.arange(8)[None], "zigzag", 2)
    Array([[0, 1, 6, 7, 2, 3, 4, 5]], dtype=int32)
  """
  return _reorder("to_layout", x, layout, axis_size, seq_axis, False)


def from_layout(x, layout: str, axis_size: int, seq_axis: int = 1):
  """Puts a sequence laid out by `to_layout` back in its global order.

  Args:
    x: an array laid out by `to_layout(..., layout, axis_size, seq_axis)`.
    layout: "contiguous" (returns `x`) or "zigzag".
    axis_size: the number of devices the sequence is sharded over.
    seq_axis: the sequence dimension of `x`.

  Returns:
    `x` in the global order.

  Example:
    >>> import jax.numpy as jnp
    >>> import jax_overlap
    >>> x = jax_overlap.to_layout(jnp.arange(8)[None], "zigzag", 2)
    >>> jax_overlap.from_layout(x, "zigzag", 2)
    Array([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=int32)
  """
  return _reorder("from_layout", x, layout, axis_size, seq_axis, True)
