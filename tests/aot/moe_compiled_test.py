"""expert_parallel on the real TPU v5e and H100 compilers, ahead of time.

With `chunks=c`, a pass (the forward, or the backward of value_and_grad)
has c + 2 all-to-alls: chunk 0's dispatch, then one a step carrying chunk
i+1's dispatch and chunk i-1's combine together, in flight while the
experts compute chunk i, then the last chunk's combine. So in the compiled
schedule every all-to-all of a pass but its first (before any expert runs)
and its last (after every expert ran) has an expert matmul between its
start and its done, and no two are in flight at once (TPU v5e, libtpu
0.0.52, takes one async all-to-all at a time: a second would be lowered
synchronously, with a CollectiveNotAsyncWarning). The expert's matmuls are
found by name (a `jax.named_scope`, which the backward's transposed matmuls
keep).

Shapes are tiny (32 tokens a device of width 16, 16 experts, 2 a device) and
each program compiles once a module (`_compiled` caches by its arguments).
The older-jax lanes (`make test-aot-jaxX`) do not collect this module: there
a future's halves are lowered back to back.
"""

from __future__ import annotations

import functools
import re
import warnings

import compilers  # noqa: F401 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import schedule
from compilers import P, arg, compiled_text, target

import jax_overlap
from jax_overlap._src import _compat
from jax_overlap._src.collectives import not_async

pytestmark = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU/GPU")

TOKENS, WIDTH, HIDDEN, LOCAL, K = 32, 16, 32, 2, 2
CAPACITY = 8          # of an average 32 x 2 / 16 = 4 a (device, expert) pair
EXPERT_SCOPE = "moe_expert"


def expert(params, tokens):
  with jax.named_scope(EXPERT_SCOPE):
    return jnp.tanh(tokens @ params["w_in"]) @ params["w_out"]


def is_expert_matmul(instr: schedule.Instr) -> bool:
  return bool(re.search(rf'op_name="[^"]*{EXPERT_SCOPE}[^"]*dot_general', instr.line))


def moe_program(t, chunks: int, grad: bool, capacity=CAPACITY):
  """The MoE block (value_and_grad of a loss with `grad`); `capacity=None`
  is dropless (its `dropped` a zero here, so both return the same)."""
  n = t.n

  def block(x, ids, weights, params):
    out = jax_overlap.expert_parallel(
        expert, x, ids, weights, params, axis="x", capacity=capacity, chunks=chunks)
    y, dropped = out if capacity is not None else (out, jnp.zeros((), jnp.int32))
    return y, dropped[None]

  moe = jax.shard_map(block, mesh=t.mesh, in_specs=(P("x"),) * 4,
                      out_specs=(P("x"), P("x")))
  fn = moe
  if grad:
    fn = jax.value_and_grad(lambda *a: jnp.sum(moe(*a)[0] ** 2), argnums=(0, 2, 3))
  experts = LOCAL * n
  args = (arg(t, (n * TOKENS, WIDTH), P("x")),
          arg(t, (n * TOKENS, K), P("x"), jnp.int32),
          arg(t, (n * TOKENS, K), P("x")),
          {"w_in": arg(t, (experts, WIDTH, HIDDEN), P("x")),
           "w_out": arg(t, (experts, HIDDEN, WIDTH), P("x"))})
  return fn, args


@functools.cache
def _compiled(name: str, chunks: int, grad: bool,
              capacity=CAPACITY) -> tuple[str, tuple[str, ...]]:
  """(scheduled text, what the library said while compiling it)."""
  fn, args = moe_program(target(name), chunks, grad, capacity)
  not_async._warned.clear()   # said once a process: each compile says its own
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = compiled_text(fn, *args)
  return text, tuple(str(w.message) for w in caught
                     if issubclass(w.category, jax_overlap.CollectiveNotAsyncWarning))


def all_to_all_windows(text: str) -> list[schedule.Window]:
  """The async all-to-alls of the scheduled module (start, what runs, done)."""
  return [w for w in schedule.windows(text) if w.kind == "all-to-all"]


def _cases():
  # H100 compiles cost 6-16 s each: the default chunks=2 with its backward,
  # and chunks=4 forward; TPU v5e (2-4 s) all four.
  for name, chunks, grad in [("gpu_h100", 2, True), ("gpu_h100", 4, False),
                             *[("tpu_v5e", c, g) for c in (2, 4) for g in (False, True)]]:
    yield pytest.param(name, chunks, grad, id=(
        f"{name}-chunks{chunks}-{'value_and_grad' if grad else 'forward'}"))


CASES = list(_cases())

@pytest.mark.parametrize("name,chunks,grad", CASES)
def test_all_to_alls_are_in_flight_across_the_expert_matmuls(name, chunks, grad):
  text, warned = _compiled(name, chunks, grad)
  pairs = all_to_all_windows(text)
  in_flight = [w for w in pairs if any(map(is_expert_matmul, w.between))]
  # Of each pass's chunks + 2 all-to-alls, all but its first and its last.
  passes = 2 if grad else 1
  wanted = chunks * passes
  assert len(pairs) == (chunks + 2) * passes, len(pairs)
  assert len(in_flight) >= wanted, (
      f"{len(in_flight)} of {len(pairs)} async all-to-alls have an expert matmul "
      f"in flight; wanted {wanted}",
      [(w.computation, w.start, w.done, sum(map(is_expert_matmul, w.between)))
       for w in pairs])
  assert not warned, warned


OTHER_SCOPE = "other_work"


def stream_program(t):
  """value_and_grad of expert_stream over 2 token groups in one ordered
  block: group 1's own matmul (the caller's work, named OTHER_SCOPE)
  between the sends, and another after close() before the last done()."""
  n, half = t.n, TOKENS // 2

  @jax_overlap.program_order(enforce=True)
  def block(x, ids, weights, params, mix):
    stream = jax_overlap.expert_stream(expert, params, axis="x", capacity=CAPACITY)
    stream.send(x[:half], ids[:half], weights[:half])
    with jax.named_scope(OTHER_SCOPE):
      other = jnp.tanh(x[half:] @ mix)
    stream.send(other, ids[half:], weights[half:])
    first, last = stream.close()
    y0, _ = first.done()
    with jax.named_scope(OTHER_SCOPE):
      after = jnp.tanh(y0 @ mix)
    y1, _ = last.done()
    return jnp.concatenate([after, y1])

  moe = jax.shard_map(block, mesh=t.mesh, in_specs=(P("x"),) * 4 + (P(),),
                      out_specs=P("x"))
  # (not differentiated in `mix`: its gradient is a sum over "x", replicated)
  fn = jax.value_and_grad(lambda *a: jnp.sum(moe(*a) ** 2), argnums=(0, 2, 3))
  experts = LOCAL * n
  args = (arg(t, (n * TOKENS, WIDTH), P("x")),
          arg(t, (n * TOKENS, K), P("x"), jnp.int32),
          arg(t, (n * TOKENS, K), P("x")),
          {"w_in": arg(t, (experts, WIDTH, HIDDEN), P("x")),
           "w_out": arg(t, (experts, HIDDEN, WIDTH), P("x"))},
          arg(t, (WIDTH, WIDTH), P()))
  return fn, args


@pytest.mark.parametrize("name", ["gpu_h100", "tpu_v5e"])
def test_a_streams_exchanges_are_all_in_flight(name):
  # expert_stream (patterns/moe/stream.py), 2 groups: 4 all-to-alls a pass,
  # each beside the experts or the caller's work (d(0) beside group 1's
  # matmul, d(1) and c(0) beside the experts, c(1) beside the matmul after
  # close()), forward and backward (the backward's exchanges are autodiff's
  # transposes, in their TPU form on the v5e: transposed_forms.py); none
  # synchronous, one in flight at a time. expert_parallel leaves a pass's
  # first and last bare (the test above).
  fn, args = stream_program(target(name))
  not_async._warned.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = compiled_text(fn, *args)
  warned = [str(w.message) for w in caught
            if issubclass(w.category, jax_overlap.CollectiveNotAsyncWarning)]
  pairs = all_to_all_windows(text)
  other = lambda i: re.search(rf'op_name="[^"]*{OTHER_SCOPE}[^"]*dot_general', i.line)
  beside = [w for w in pairs if any(is_expert_matmul(i) or other(i) for i in w.between)]
  assert len(pairs) == 8, len(pairs)
  assert len(beside) == 8, [(w.start, w.done) for w in pairs if w not in beside]
  assert not re.search(r"all-to-all\(", text), "a synchronous all-to-all"
  assert not warned, warned


def test_a_synchronous_dispatch_has_nothing_in_flight_on_h100():
  # What the check above tells apart: the same block with plain
  # jax.lax.all_to_all (no futures, one chunk) has no expert matmul between
  # an all-to-all's start and done (H100 compiles them synchronous).
  t = target("gpu_h100")

  def block(x, params):
    n, e = t.n, LOCAL
    sent = x.reshape(n, e, -1, WIDTH)
    arrived = jax.lax.all_to_all(sent, "x", 0, 0, tiled=True)
    tokens = arrived.transpose(1, 0, 2, 3).reshape(e, -1, WIDTH)
    out = jax.vmap(expert)(params, tokens).reshape(e, n, -1, WIDTH)
    return jax.lax.all_to_all(out.transpose(1, 0, 2, 3), "x", 0, 0,
                              tiled=True).reshape(x.shape)

  fn = jax.shard_map(block, mesh=t.mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
  experts = LOCAL * t.n
  text = compiled_text(fn, arg(t, (t.n * TOKENS, WIDTH), P("x")),
                       {"w_in": arg(t, (experts, WIDTH, HIDDEN), P("x")),
                        "w_out": arg(t, (experts, HIDDEN, WIDTH), P("x"))})
  assert "moe_expert" in text
  assert not [w for w in all_to_all_windows(text)
              if any(map(is_expert_matmul, w.between))]


# --- dropless: a ragged all-to-all, synchronous ----------------------------------

def platform_is_tpu(name: str) -> bool:
  return name.startswith("tpu")


def _dense_all_to_alls(text: str) -> list[str]:
  """The element types of the plain (not ragged) all-to-alls, sync or async."""
  return re.findall(r"= \(?\(?([a-z0-9]+)\[[^=]*? all-to-all(?:-start)?\(", text)


@pytest.mark.parametrize("name,grad", [
    pytest.param(name, grad, id=f"{name}-{'value_and_grad' if grad else 'forward'}")
    for name in ("gpu_h100", "tpu_v5e") for grad in (False, True)])
def test_dropless_sends_the_routed_rows_by_ragged_all_to_all(name, grad):
  # capacity=None, chunks=2: each chunk's dispatch and combine is a real
  # ragged-all-to-all (2 a chunk a pass) of the [E * C_c, D] slots, sending
  # only each expert's routed rows; the one dense all-to-all left is of the
  # row counts (s32[chunks, devices, E_local]), not the E x T*k x D padded
  # buffers every backend got before. XLA has no async ragged pair a
  # program can place, so it is said once that the pass overlaps nothing.
  chunks = 2
  text, warned = _compiled(name, chunks, grad, None)
  ragged = re.findall(r" ragged-all-to-all(?:-start)?\(", text)
  assert len(ragged) == 2 * chunks * (2 if grad else 1), len(ragged)
  assert _dense_all_to_alls(text) == ["s32"], _dense_all_to_alls(text)
  # TPU makes some or all of them start/done pairs (how many depends on how
  # XLA places the fences: 4 of 4 forward before program_order fenced past
  # input-free equations, 2 of 4 since), never with an expert matmul in the
  # window; H100 runs each whole.
  windows = [w for w in schedule.windows(text) if w.kind == "ragged-all-to-all"]
  if platform_is_tpu(name):
    assert 1 <= len(windows) <= len(ragged), windows
  else:
    assert not windows, windows
  assert not [w for w in windows if any(map(is_expert_matmul, w.between))]
  platform = "tpu" if platform_is_tpu(name) else "cuda"
  assert len(warned) == 1 and warned[0].startswith(
      f"expert_parallel(capacity=None) on {platform}:"), warned


# --- fsdp_scan beside an expert stream: who holds the v5e's one slot --------------

FSDP_EP = (2, 4)      # the target's 8 devices as ("fsdp", "ep")


def fsdp_stream_program(t):
  """value_and_grad of fsdp_scan over 2 layers, each a projection and a
  router (sharded over "fsdp") and an expert_stream over "ep" of the
  layer's tokens in 2 groups (its experts sharded over "ep" and "fsdp"),
  in one ordered block as llama_4d's `moe_stream`."""
  mesh = jax.sharding.Mesh(np.asarray(t.mesh.devices).reshape(FSDP_EP), ("fsdp", "ep"))
  half = TOKENS // 2

  def layer(w, x):
    @jax_overlap.program_order(enforce=True)
    def run(w, x):
      stream = jax_overlap.expert_stream(
          expert, {"w_in": w["w_in"], "w_out": w["w_out"]}, axis="ep", capacity=half)
      parts = [x[:half], x[half:]]
      for c in range(2):
        h = jax_overlap.program_order(enforce=False)(
            lambda x=parts[c]: jnp.tanh(x @ w["proj"]))()
        weights, ids = jax.lax.top_k(jax.nn.softmax(h @ w["router"]), K)
        stream.send(h, ids, weights)
      return jnp.concatenate([p + out.done()[0] for p, out in zip(parts, stream.close())])
    return run(w, x)

  def body(x, params):
    return jnp.sum(jax_overlap.fsdp_scan(
        layer, x, params, axis="fsdp", params_first=True,
        shard_dims={"proj": 1, "router": 1, "w_in": 2, "w_out": 3}) ** 2)[None]

  loss = jax.shard_map(body, mesh=mesh, in_specs=(
      P(("fsdp", "ep")), {"proj": P(None, "fsdp"), "router": P(None, "fsdp"),
                          "w_in": P(None, "ep", "fsdp"), "w_out": P(None, "ep", None, "fsdp")}),
      out_specs=P(("fsdp", "ep")))
  fn = jax.value_and_grad(lambda *a: loss(*a).sum(), argnums=(0, 1))
  n, layers, experts = t.n, 2, LOCAL * FSDP_EP[1]
  lay = lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, spec))
  args = (lay((n * TOKENS, WIDTH), P(("fsdp", "ep"))),
          {"proj": lay((layers, WIDTH, WIDTH), P(None, "fsdp")),
           "router": lay((layers, WIDTH, experts), P(None, "fsdp")),
           "w_in": lay((layers, experts, WIDTH, HIDDEN), P(None, "ep", "fsdp")),
           "w_out": lay((layers, experts, HIDDEN, WIDTH), P(None, "ep", None, "fsdp"))})
  return fn, args


def test_fsdp_beside_an_expert_stream_keeps_every_collective_async():
  # The v5e keeps one async all-to-all in flight. fsdp_scan's reduce-scatter
  # form (an all-to-all) held it across a layer's backward, and the layer's
  # exchanges (or fsdp's own pieces) ran as their synchronous fallback,
  # all-gathers: 13 of them here, 4 async. Beside a layer that starts
  # all-to-alls, fsdp_scan moves by permutes (patterns/fsdp/all_to_all_slot.py):
  # no synchronous gather or exchange, every pair with compute in flight.
  # (The sums over "ep" of the projection's and router's gradients, which
  # are replicated over it, are autodiff's all-reduces: not counted here.)
  fn, args = fsdp_stream_program(target("tpu_v5e"))
  text = compiled_text(fn, *args)
  pairs = schedule.windows(text)
  computing = lambda w: any(i.is_matmul or i.opcode in ("fusion", "custom-call", "convolution")
                            for i in w.between)
  kinds = {w.kind for w in pairs}
  assert {"all-to-all", "collective-permute"} <= kinds, kinds
  assert "all-gather" not in kinds and "reduce-scatter" not in kinds, kinds
  assert all(computing(w) for w in pairs), [(w.kind, w.start) for w in pairs if not computing(w)]
  sync = re.findall(r"= [^=]*? (all-gather|all-to-all|reduce-scatter)\(", text)
  assert not sync, sync
