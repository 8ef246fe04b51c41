"""A future finished in another region than the one that started it.

`lowering.py` lowers a done to `<op>-done` on the start custom call it finds
by walking back from the in-flight value (through `program_order`'s
barriers). A future started in one `jax.shard_map` and finished in another
(fsdp_scan on an explicit mesh, patterns/fsdp/explicit_futures.py) reaches
its done as an argument of the second shard_map's body: the walk finds no
start, the done is the identity, and XLA refuses the lone start ("Custom
emitter for all-gather-start not found", TPU v5e, libtpu 0.0.52).

So each start that lowered to an async pair says so in the module's lowering
cache, keyed by its `Comm` (the start and the done of one future share it),
and a done whose walk finds nothing finishes the pair it names. A start that
stayed synchronous (a TPU form that found its all-to-all slot taken) records
nothing, and its done stays the identity. The rules are `lowering.py`'s,
wrapped (registered again with the same platforms and `split`).

jax 0.12 only (`_compat.ASYNC_CUSTOM_CALLS`): older jax lowers a future's
halves back to back, and there is nothing in flight to find.
"""

from __future__ import annotations

import functools

from jax._src.interpreters import mlir

from jax_overlap._src import _compat
from jax_overlap._src.collectives import lowering
from jax_overlap._src.collectives.primitives import (collective_done_p,
                                                     collective_start_p)

_KEY = "jax_overlap started"


def _started(ctx) -> dict:
  cache = ctx.module_context.cached_primitive_lowerings
  return cache.setdefault(_KEY, {})


def _lower_start(ctx, x, *aux, comm, split):
  out = lowering._lower_start(ctx, x, *aux, comm=comm, split=split)
  name, _ = lowering._find_start(out[0])
  if name is not None:
    _started(ctx)[comm] = name
  else:   # one Comm lowered twice (a block traced once, called twice)
    _started(ctx).pop(comm, None)
  return out


def _lower_done(ctx, in_flight, *operand, comm):
  name, _ = lowering._find_start(in_flight)
  recorded = _started(ctx).get(comm)
  if name is not None or recorded is None:
    return lowering._lower_done(ctx, in_flight, *operand, comm=comm)
  # The start is in another region: finish the pair it recorded, as
  # lowering._lower_done does where it sees it.
  done = lowering._done_custom_call(recorded, in_flight)
  if comm.tpu_form is not None and lowering._platforms(ctx) == ("tpu",):
    lowering._free_tpu_all_to_all_slot(ctx, done)
  if comm.tpu_form is not None:
    return [lowering._lower_form_done(ctx, done, comm)]
  return [done]


if _compat.ASYNC_CUSTOM_CALLS:
  mlir.register_lowering(collective_done_p, _lower_done, cacheable=False)
  for _platform in ("cuda", "rocm", "tpu"):
    mlir.register_lowering(collective_start_p,
                           functools.partial(_lower_start, split=True),
                           platform=_platform, cacheable=False)
