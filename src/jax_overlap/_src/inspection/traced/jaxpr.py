"""Reading a traced program (`jax.jit(f).trace(*a).jaxpr`): its equations,
the jaxprs nested in them, and the bytes, flops and group size of one
equation. `written.py` and `written_schedule.py` both read through here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from jax._src import source_info_util

#: Kernels: an equation that runs as one compiled kernel, never looked into.
KERNEL_PRIMITIVES = frozenset({
    "ffi_call", "pallas_call", "custom_call", "tpu_custom_call",
    "mosaic_gpu_call", "triton_kernel_call"})

#: Our collectives (`Comm.name`) by the HLO collective they lower to.
HLO_KIND = {"all_gather": "all-gather", "psum": "all-reduce",
            "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all",
            "ppermute": "collective-permute",
            "ragged_all_to_all": "ragged-all-to-all"}

_SHORT_DTYPES = {"bool": "pred", "bfloat16": "bf16"}
_NUMERIC_DTYPE = re.compile(r"(float|int|uint|complex)(\d+)(?:_(\w+))?")


def eqns(jaxpr) -> list[Any]:
  """The equations of a `Jaxpr` or `ClosedJaxpr`."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  return getattr(inner, "eqns", getattr(jaxpr, "eqns", []))


def open_vars(jaxpr) -> tuple[list[Any], list[Any]]:
  """(invars, outvars) of a `Jaxpr` or `ClosedJaxpr`."""
  inner = jaxpr if hasattr(jaxpr, "invars") else jaxpr.jaxpr
  return list(inner.invars), list(inner.outvars)


def sub_jaxprs(value) -> list[Any]:
  """The jaxprs held by a parameter value (one, or a tuple of them)."""
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in sub_jaxprs(v)]
  if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
    return [value]
  return []


def inner_axis_sizes(eqn, axis_sizes: dict[str, int]) -> dict[str, int]:
  """Axis sizes inside `eqn`: a `shard_map` adds its mesh's."""
  mesh = eqn.params.get("mesh")
  if mesh is not None and hasattr(mesh, "shape"):
    return {**axis_sizes, **dict(mesh.shape)}
  return axis_sizes


def group_size(eqn, axis_sizes: dict[str, int]) -> int | None:
  """Devices in one group of the collective `eqn`, from its axis names (or
  `axis_index_groups`, or its own `axis_size`); None when they are unknown."""
  groups = eqn.params.get("axis_index_groups")
  if groups:
    return len(groups[0])
  if isinstance(eqn.params.get("axis_size"), int):
    return eqn.params["axis_size"]
  names = eqn.params.get("axis_name", eqn.params.get("axes"))
  if names is None:
    return None
  names = names if isinstance(names, (tuple, list)) else (names,)
  sizes = [axis_sizes.get(n) for n in names if not isinstance(n, int)]
  if sizes and all(s is not None for s in sizes):
    return math.prod(sizes)
  return None


def comm_group_size(comm, axis_sizes: dict[str, int]) -> int | None:
  """The group size of a future's collective (`Comm.jaxpr`)."""
  for eqn in eqns(comm.jaxpr):
    size = group_size(eqn, axis_sizes)
    if size is not None:
      return size
  return None


def _array(aval):
  """The array type inside `aval` (a jax async future holds one)."""
  return getattr(aval, "inner_aval", aval)


def aval_bytes(aval) -> float:
  aval = _array(aval)
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  try:
    return float(math.prod(shape) * dtype.itemsize)
  except (TypeError, AttributeError):
    return 0.0


def hlo_dtype(aval) -> str | None:
  """The HLO element type of `aval` ('f32', 'bf16', 'pred', 'f8e4m3fn'),
  None for types HLO text has no name for."""
  name = str(getattr(_array(aval), "dtype", ""))
  if name in _SHORT_DTYPES:
    return _SHORT_DTYPES[name]
  m = _NUMERIC_DTYPE.fullmatch(name)
  if not m:
    return None
  kind, bits, suffix = m.groups()
  letter = {"float": "f", "int": "s", "uint": "u", "complex": "c"}[kind]
  return f"{letter}{bits}{suffix or ''}"


def aval_text(aval) -> str:
  """`f32[8,32]`, as HLO writes a shape."""
  aval = _array(aval)
  dtype = hlo_dtype(aval) or str(getattr(aval, "dtype", "?"))
  return f"{dtype}[{','.join(str(d) for d in getattr(aval, 'shape', ()))}]"


def flops(eqn) -> float:
  """Flops of a dot (2 * result elements * contracted size) or a
  convolution (2 * result elements * kernel elements per output feature);
  0 for everything else."""
  name = eqn.primitive.name
  out = eqn.outvars[0].aval
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d]
                                                  for d in lhs_contract)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    numbers = eqn.params.get("dimension_numbers")
    out_feature = numbers.rhs_spec[0] if numbers is not None else 0
    per_output = math.prod(rhs.shape) / max(rhs.shape[out_feature], 1)
    return 2.0 * math.prod(out.shape) * per_output
  return 0.0


def name_stack(eqn) -> str:
  """The scopes `eqn` was written in ('' when none), as op_name has them."""
  try:
    return str(eqn.source_info.name_stack)
  except AttributeError:
    return ""


def source_line(eqn) -> tuple[str, int] | None:
  """(file, line) of the user's code that wrote `eqn`, if known."""
  try:
    frame = source_info_util.user_frame(eqn.source_info.traceback)
  except (AttributeError, TypeError):
    return None
  if frame is None:
    return None
  return frame.file_name, frame.start_line
