"""Reading lowered programs in tests: barrier counts and op order."""

from __future__ import annotations

import re

import jax

from jax_overlap._src import _compat

HAS_LOJAX = _compat.USE_HIJAX


def stablehlo(fn, *args, **kwargs) -> str:
  return jax.jit(fn).lower(*args, **kwargs).as_text()


def barriers_in_stablehlo(fn, *args, **kwargs) -> int:
  """Counts `stablehlo.optimization_barrier` ops in the lowered program."""
  return len(re.findall(r"stablehlo\.optimization_barrier",
                        stablehlo(fn, *args, **kwargs)))


def traced_jaxpr(fn, *args, **kwargs):
  return jax.jit(fn).trace(*args, **kwargs).jaxpr


def lojax_jaxpr(fn, *args, **kwargs):
  """The lojax jaxpr where jax has one (>= 0.12); else None."""
  traced = jax.jit(fn).trace(*args, **kwargs)
  return traced.lojax.jaxpr if HAS_LOJAX else None


def count_in_jaxpr(jaxpr, name: str) -> int:
  return str(jaxpr).count(name)


def stablehlo_ops(text: str, names) -> list[str]:
  """The ops among `names` in the order they appear in StableHLO text."""
  pattern = "|".join(re.escape(n) for n in names)
  return re.findall(rf"(?:stablehlo\.|\b)({pattern})\b", text)
