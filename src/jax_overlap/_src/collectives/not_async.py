"""Saying so when a collective the user wanted in flight compiles synchronous.

Two cases, each said once per process with a `CollectiveNotAsyncWarning`:

* a future the backend cannot compile as an async pair, which the library
  lowers synchronously instead (values unchanged, nothing in flight): on TPU
  (quirks.py, "tpu-collective-forms") a `psum_scatter_start`, `psum_start` or `all_to_all_start`
  (and on v5p an `all_gather_start`) that has no TPU form (tpu_forms.py,
  permute_forms.py:
  several axis names, vmap, a transpose made by autodiff), and the futures in
  TPU form of a program holding more than one where libtpu refuses them in
  flight (it allows one async all-to-all at a time) or aborts on them (v5p);
  and a `ragged_all_to_all_start` on GPU or TPU (XLA has no async custom call
  for it: the real op runs whole at the start), among them the dropless
  exchange of `expert_parallel(capacity=None)`, which says so in its own
  words (`Comm.sync_note`);
* a plain synchronous collective (`jax.lax.all_gather`, `psum`, ...) inside
  an ordered block compiled for TPU or GPU: the fences keep it synchronous
  where XLA left to itself would have made it async. Use its `*_start`
  future, with the work to overlap written between start and `done()`.

Silence it with
`warnings.filterwarnings("ignore", category=jax_overlap.CollectiveNotAsyncWarning)`.
"""

from __future__ import annotations

import warnings

from jax_overlap._src.ordering import block_collectives

_warned: set[str] = set()

#: Marks the MLIR op of a future lowered synchronously (on this backend): it
#: was said with its own warning, so it is not also "a synchronous collective
#: fenced in an ordered block".
SYNC_FUTURE_ATTR = "jax_overlap.sync_future"

#: Synchronous collectives (jax primitive names, across our versions). One
#: that ends an ordered block gets its outputs fenced too, as every other
#: equation's are by the next one's barrier: a collective inside an ordered
#: block is then one that both reads and feeds a barrier, which is how
#: `xla/compile_options.fenced_sync_collectives` tells it from one that
#: merely reads a block's result after the block (jax's psum of a replicated
#: input's gradient), which XLA stays free to overlap.
SYNC_COLLECTIVES = frozenset({
    "psum", "psum2", "psum_invariant", "pmax", "pmin", "all_gather",
    "all_gather_invariant", "reduce_scatter", "psum_scatter", "all_to_all",
    "ppermute", "ragged_all_to_all"})
block_collectives.add_synchronous(SYNC_COLLECTIVES)


class CollectiveNotAsyncWarning(UserWarning):
  """A collective compiles synchronous where the program asked for overlap.

  Silence it with `warnings.filterwarnings("ignore",
  category=jax_overlap.CollectiveNotAsyncWarning)`.
  """


def warn_once(key: str, message: str) -> None:
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(message, CollectiveNotAsyncWarning, stacklevel=3)


_FUTURE_OF = {"reduce-scatter": "psum_scatter_start", "all-reduce": "psum_start",
              "all-to-all": "all_to_all_start", "all-gather": "all_gather_start"}


def warn_future_lowered_sync(platform: str, name: str, why: str) -> None:
  future = _FUTURE_OF.get(name, name)
  warn_once(f"future:{platform}:{name}", (
      f"{future} on {platform}: {why}; jax_overlap lowers it as a synchronous "
      f"collective there (values unchanged, nothing in flight between start "
      f"and done()). Silence with warnings.filterwarnings('ignore', "
      f"category=jax_overlap.CollectiveNotAsyncWarning)."))


def warn_fenced_sync_collective(platform: str, op_names: list[str]) -> None:
  """Says once per (platform, ops) that the fences keep these plain
  collectives synchronous, naming each one's future: `op_names` are jax.lax
  names, and each has its `_start` (tests/aot/real_compilers_test.py::
  test_a_plain_gather_in_an_ordered_block_is_said)."""
  names = sorted(set(op_names))
  ops = ", ".join(f"jax.lax.{n}" for n in names)
  futures = ", ".join(f"jax_overlap.{n}_start" for n in names)
  warn_once(f"fenced:{platform}:{ops}", (
      f"program_order: a synchronous collective ({ops}) inside an ordered "
      f"block, compiled for {platform}: the fences keep it synchronous, where "
      f"XLA by itself may have made it async and overlapped it. To overlap it, "
      f"use its future ({futures}) and write the work to overlap between "
      f"the start and done(). Silence with warnings.filterwarnings('ignore', "
      f"category=jax_overlap.CollectiveNotAsyncWarning)."))
