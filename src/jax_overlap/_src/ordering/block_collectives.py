"""What the barrier interpreter asks about collectives: a registry they fill in.

`barriers.run_in_order` treats two kinds of equation apart, and learns
which from here, not by importing the collectives (which sit above
ordering):

* synchronous collectives (jax primitive names, `add_synchronous`; filled in
  by collectives/not_async.py): one that ends an ordered block gets its
  outputs fenced too, and one that starts a block of more than one equation
  is bound in `FENCED_SCOPE`, so that `xla/compile_options.py`'s
  `fenced_sync_collectives` tells a collective inside a block from one that
  reads a block's result after it;
* rewrites of a block's jaxpr before it is fenced (`add_block_rewrite`;
  collectives/ring_psum.py moves psum_start's second ring half up into the
  first half's window).

Invariant: a registry that nothing filled in leaves `run_in_order` fencing
every equation as any other (a program without our collectives' modules
holds no ring half; the lowering rules, xla/, import the modules that fill
it in). Pinned by tests/integration/layering_test.py (ordering imports no
collective) and tests/aot/real_compilers_test.py::
test_a_plain_gather_in_an_ordered_block_is_said.
"""

from __future__ import annotations

from typing import Callable, Iterable

#: The named scope a synchronous collective that starts an ordered block is
#: bound in (barriers.py): found by its location at compile time.
FENCED_SCOPE = "jax_overlap.fenced_collective"

_SYNCHRONOUS: set[str] = set()
_REWRITES: list[Callable] = []


def add_synchronous(names: Iterable[str]) -> None:
  """Names jax primitives that are synchronous collectives."""
  _SYNCHRONOUS.update(names)


def is_synchronous(name: str) -> bool:
  return name in _SYNCHRONOUS


def add_block_rewrite(rewrite: Callable) -> None:
  """`rewrite(jaxpr) -> jaxpr`, applied to an ordered block's open jaxpr
  before it is fenced; it must keep the values (it may move equations)."""
  if rewrite not in _REWRITES:
    _REWRITES.append(rewrite)


def rewrite(jaxpr):
  """`jaxpr` through every registered rewrite, in the order they were added."""
  for fn in _REWRITES:
    jaxpr = fn(jaxpr)
  return jaxpr
