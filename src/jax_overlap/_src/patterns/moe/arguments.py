"""The checks at the call of `expert_parallel`: each names the argument."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from jax_overlap._src import _compat
from jax_overlap._src.patterns.bound_axis import one_axis_size

NAME = "expert_parallel"


class Call(NamedTuple):
  """The static description of one call."""

  axis: Any
  size: int            # devices along `axis`
  experts_local: int   # E_local
  tokens: int          # T
  k: int
  chunks: int
  capacity: int | None

  @property
  def experts(self) -> int:
    return self.experts_local * self.size


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(
      value, (bool, np.bool_))


def _shape(a) -> tuple:
  return tuple(np.shape(a))


def _check_dtype(arg: str, value, kind, what: str, name: str = NAME) -> None:
  dtype = jnp.result_type(value)
  if not jnp.issubdtype(dtype, kind):
    raise TypeError(f"{name}({arg}=...) must be {what}, got dtype {dtype}.")


def check_call(expert_fn, x, expert_ids, weights, expert_params, *, axis,
               capacity, chunks, name: str = NAME) -> Call:
  """The call's `Call`; an error names the argument, as `name(arg=...)`."""
  if not callable(expert_fn):
    raise TypeError(
        f"{name}(expert_fn=...) must be a function "
        f"expert_fn(expert_params_e, tokens[C, D]) -> [C, D], got "
        f"{expert_fn!r}.")
  size = _axis_size(axis, name)
  if np.ndim(x) != 2:
    raise ValueError(
        f"{name}(x=...) must be this device's tokens, shape [T, D], got shape "
        f"{_shape(x)}. Flatten batch and sequence into one token dimension "
        "first (x.reshape(-1, D)).")
  tokens = _shape(x)[0]
  if np.ndim(expert_ids) != 2 or _shape(expert_ids)[0] != tokens:
    raise ValueError(
        f"{name}(expert_ids=...) must be [T, k], each token's chosen experts, "
        f"with T = {tokens} as in x (shape {_shape(x)}); got shape "
        f"{_shape(expert_ids)}.")
  _check_dtype("expert_ids", expert_ids, jnp.integer,
               "integers (expert indices)", name)
  k = _shape(expert_ids)[1]
  if _shape(weights) != _shape(expert_ids):
    raise ValueError(
        f"{name}(weights=...) must have the shape of expert_ids, [T, k] = "
        f"{_shape(expert_ids)}: one combine weight per chosen expert; got "
        f"shape {_shape(weights)}.")
  _check_dtype("weights", weights, jnp.floating,
               "floating point (combine weights)", name)
  experts_local = _experts_local(expert_params, name)
  _check_params_vary(expert_params, axis, size, experts_local, name)
  chunks = _chunks(chunks, tokens, name)
  capacity = _capacity(capacity, name)
  call = Call(axis, size, experts_local, tokens, k, chunks, capacity)
  _check_concrete_ids(expert_ids, call, name)
  return call


def _axis_size(axis, name: str = NAME) -> int:
  return one_axis_size(name, axis, several="experts spread over several axes "
                       "are not supported.")


def _experts_local(expert_params, name: str = NAME) -> int:
  leaves, _ = jax.tree_util.tree_flatten_with_path(expert_params)
  if not leaves:
    raise ValueError(
        f"{name}(expert_params=...) has no arrays; give each local expert's "
        "parameters stacked along a leading E_local dimension.")
  leading = {}
  for path, leaf in leaves:
    leaf_name = jax.tree_util.keystr(path) or "(expert_params itself)"
    if np.ndim(leaf) < 1:
      raise ValueError(
          f"{name}(expert_params=...): leaf {leaf_name} is a scalar; every leaf "
          "needs a leading E_local dimension (the experts on this device).")
    leading[leaf_name] = _shape(leaf)[0]
  if len(set(leading.values())) > 1:
    raise ValueError(
        f"{name}(expert_params=...): the leading (E_local) dimension differs "
        f"between leaves: {leading}. Stack every parameter over the same "
        "local experts.")
  experts_local = next(iter(leading.values()))
  if experts_local < 1:
    raise ValueError(
        f"{name}(expert_params=...): the leading (E_local) dimension is 0; "
        "each device needs at least one expert.")
  return experts_local


def _check_params_vary(expert_params, axis, size: int,
                       experts_local: int, name: str = NAME) -> None:
  """Each device holds its own experts: a leaf replicated over `axis` would
  count the same experts once per device. Seen only where shard_map tracks
  variance (check_vma=True)."""
  if size == 1:
    return
  for path, leaf in jax.tree_util.tree_flatten_with_path(expert_params)[0]:
    vma = _compat.varying_axes(leaf)
    if vma is not None and axis not in vma:
      leaf_name = jax.tree_util.keystr(path) or "(expert_params itself)"
      raise ValueError(
          f"{name}(expert_params=...): leaf {leaf_name} does not vary over axis "
          f"{axis!r} (shard_map's in_specs left it replicated), so each of "
          f"the {size} devices would hold the same {experts_local} experts. "
          f"Shard the expert dimension over {axis!r} (in_specs P({axis!r}) "
          f"for an [E, ...] array, E = E_local * {size}: a multiple of the "
          "axis size).")


def _chunks(chunks, tokens: int, name: str = NAME) -> int:
  if not _is_int(chunks):
    raise TypeError(f"{name}(chunks=...) must be an int >= 1, got {chunks!r}.")
  if chunks < 1:
    raise ValueError(f"{name}(chunks=...) must be an int >= 1, got {chunks}.")
  if tokens % chunks:
    divisors = [d for d in range(1, tokens + 1) if tokens % d == 0]
    raise ValueError(
        f"{name}(chunks={chunks}): x has T = {tokens} tokens, which {chunks} "
        f"chunks cannot split evenly. Give chunks dividing T (one of "
        f"{divisors[:12]}), or pad the tokens.")
  return int(chunks)


def _capacity(capacity, name: str = NAME) -> int | None:
  if capacity is None:
    return None
  if not _is_int(capacity):
    raise TypeError(
        f"{name}(capacity=...) must be an int >= 1 (tokens each expert accepts "
        f"from each device) or None (dropless), got {capacity!r}.")
  if capacity < 1:
    raise ValueError(
        f"{name}(capacity=...) must be an int >= 1 (tokens each expert accepts "
        f"from each device) or None (dropless), got {capacity}: it would drop "
        "every token.")
  return int(capacity)


def _check_concrete_ids(expert_ids, call: Call, name: str = NAME) -> None:
  """Ids known now (not traced) are checked against `[0, E)`; traced ids
  cannot be, and an id outside is dropped (see layout.py)."""
  if isinstance(expert_ids, core.Tracer):
    return
  ids = np.asarray(expert_ids)
  if ids.size == 0:
    return
  low, high = int(ids.min()), int(ids.max())
  if low < 0 or high >= call.experts:
    bad = low if low < 0 else high
    raise ValueError(
        f"{name}(expert_ids=...) holds {bad}, outside [0, E) = [0, "
        f"{call.experts}): E = E_local * axis size = {call.experts_local} * "
        f"{call.size} (the leading dimension of expert_params on each of the "
        f"{call.size} devices of axis {call.axis!r}). Route to experts "
        f"0 .. {call.experts - 1}, or give each device more experts.")


def check_expert_output(out, tokens, experts_local: int,
                        name: str = NAME) -> None:
  """`vmap(expert_fn)`'s output for tokens [E_local, rows, D]."""
  rows = tokens.shape[1]
  if isinstance(out, (jax.Array, core.Tracer)):
    if out.ndim == 3 and out.shape[:2] == (experts_local, rows):
      return
    what = f"shape {tuple(out.shape[1:])}"       # one expert's, unbatched
  else:
    what = jax.tree.map(lambda a: tuple(np.shape(a)[1:]), out)
  raise ValueError(
      f"{name}(expert_fn=...) must return one row per token, [C, D'], for "
      f"tokens [C, D] = [{rows}, {tokens.shape[2]}]; it returned {what}.")


def check_stream_capacity(name: str, capacity) -> int:
  """A stream's capacity: an int >= 1 (no dropless form)."""
  if capacity is None:
    raise ValueError(
        f"{name}(capacity=None): a stream needs a capacity (an int >= 1, rows "
        "each expert accepts from each device per group). Dropless exchanges "
        "are ragged all-to-alls, synchronous on GPU and TPU: use "
        "expert_parallel(capacity=None) for them.")
  return _capacity(capacity, name)
