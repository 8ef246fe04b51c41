"""The TPU forms of the futures on the real TPU compiler (libtpu, ahead of
time): every future an async pair (or pairs) with the matmul between start
and done on v5e and v5p, and fsdp_scan's backward reduce-scatters in flight.

libtpu 0.0.52 crashes or refuses the plain async reduce-scatter, all-reduce
and rank-2 all-to-all, and compiles every all-gather of v5p synchronously; the
library lowers those futures there as a rank-3 all-to-all (collectives/
tpu_forms.py) with `xla_tpu_enable_async_all_to_all` on, one all-to-all in
flight at a time (the compiler allows no more: on v5e each start is tied after
the previous form's done, a module it still refuses for that is compiled again
with each form finished where it starts; on v5p several are finished at once).
On v5p all_gather_start and psum_scatter_start are instead N-1
collective-permutes in flight at once (collectives/permute_forms.py), with
`xla_max_concurrent_async_collective_permutes` raised. Values are checked on
CPU in tests/collectives/tpu_forms_test.py and tests/collectives/permute_forms_test.py; here, the
compile and the schedule.
"""

from __future__ import annotations

import os
import re
import warnings

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another compile may hold libtpu

import compilers  # noqa: E402 - first: sets JAX_PLATFORMS=cpu before jax starts
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

import real_compilers_test  # noqa: E402
import schedule  # noqa: E402
from compilers import P, arg, compiled_text, target  # noqa: E402

import jax_overlap  # noqa: E402
from jax_overlap import program_order  # noqa: E402
from jax_overlap._src import _compat  # noqa: E402
from jax_overlap._src.collectives import not_async  # noqa: E402

#: The ring's bytes run on the older jax too (tests/conftest.py, `newest_jax`).
pytestmark = pytest.mark.newest_jax(
    older_jax=["test_psum_start_moves_a_ring_all_reduces_bytes"])
#: Every test but the ring's bytes (which holds on every jax).
needs_pairs = pytest.mark.skipif(
    not _compat.ASYNC_CUSTOM_CALLS,
    reason="jax < 0.12 lowers a future's halves back to back on TPU")

N = 8

#: future -> the async pairs it compiles to, per TPU generation.
PAIR = {
    "tpu_v5e": {"all_gather": ["all-gather"], "psum": ["all-to-all", "all-gather"],
                "psum_scatter": ["all-to-all"], "all_to_all": ["all-to-all"],
                "ppermute": ["collective-permute"]},
    "tpu_v5p": {"all_gather": ["collective-permute"] * (N - 1),
                "psum": ["collective-permute"] * (2 * (N - 1)),
                "psum_scatter": ["collective-permute"] * (N - 1),
                "all_to_all": ["all-to-all"],
                "ppermute": ["collective-permute"]},
}


def _compile(fn, args, **kwargs):
  """(scheduled text, CollectiveNotAsyncWarning messages)."""
  not_async._warned.clear()   # the library says each once per process
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = compiled_text(fn, *args, **kwargs)
  return text, [str(w.message) for w in caught
                if issubclass(w.category, jax_overlap.CollectiveNotAsyncWarning)]


def _start(kind, x):
  return real_compilers_test._start(kind, x, N)


def _future_program(t, kind):
  @program_order(enforce=True)
  def body(x, w):
    future = _start(kind, x)
    y = jnp.tanh(w @ w)
    return future.done(), y

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  fn = jax.shard_map(f, mesh=t.mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  return fn, (arg(t, (64, 16), P("x")), arg(t, (16, 16)))


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
@pytest.mark.parametrize("kind", sorted(PAIR["tpu_v5e"]))
def test_each_future_is_an_async_pair_around_the_matmul(name, kind):
  t = target(name)
  text, warned = _compile(*_future_program(t, kind))
  # (v5p: a slice of the psum_scatter's chunks may be an async pair too.)
  windows = [w for w in schedule.windows(text) if w.kind != "slice"]
  assert [w.kind for w in windows] == PAIR[name][kind], windows
  # (psum_start's all-gather half, one pair on v5e and N-1 permutes on v5p,
  # starts after half of the window's matmuls, here after the one there is:
  # nothing is left for its window; ring_psum.py, and the last test with two.)
  gather = {"tpu_v5e": 1, "tpu_v5p": N - 1}[name] if kind == "psum" else 0
  hidden = windows[:len(windows) - gather]
  assert all(w.matmuls >= 1 for w in hidden), windows
  assert not warned, warned


_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2}
_SENT = re.compile(
    r"= (\w+)\[([\d,]*)\]\{[^}]*\} (all-to-all-done|all-gather-done|"
    r"collective-permute-done|all-reduce|all-gather|all-to-all|"
    r"collective-permute|reduce-scatter)\(")


def sent_bytes(text, n=N):
  """Bytes each device sends, by the collectives of a scheduled TPU module:
  (n-1)/n of an all-to-all's buffer or of an all-gather's result, a
  permute's whole buffer, 2(n-1)/n of an all-reduce's (a ring's), (n-1)
  times a reduce-scatter's result. It reads async pairs as start/done and
  plain collectives; an async-collective fusion chain (what libtpu makes of
  an all-gather it overlaps outside program_order) names its collective in
  each fusion, and would be counted once a fusion."""
  total = 0.0
  for dtype, dims, op in _SENT.findall(text):
    size = _BYTES[dtype]
    for d in filter(None, dims.split(",")):
      size *= int(d)
    op = op.removesuffix("-done")
    total += {"all-to-all": (n - 1) / n, "all-gather": (n - 1) / n,
              "collective-permute": 1, "all-reduce": 2 * (n - 1) / n,
              "reduce-scatter": n - 1}[op] * size
  return total


@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
def test_psum_start_moves_a_ring_all_reduces_bytes(name):
  # A (64, 16) f32 array over 8 devices: an (8, 16) shard, 512 bytes. A
  # ring all-reduce sends 2 * 7/8 of it, 896 bytes: a reduce-scatter of
  # 64-byte chunks (v5e: an all-to-all; v5p: 7 permutes) and an all-gather
  # of the summed chunk (v5e on jax 0.12: an all-gather; v5p, and v5e on jax
  # < 0.12, where a plain gather of a chunk under 512 bytes is synchronous:
  # 7 permutes), ring_psum.py. The all-to-all of 8 copies sent 3584, N/2
  # times that. Every collective an async pair, the first half's with the
  # matmul in flight.
  t = target(name)
  text, warned = _compile(*_future_program(t, "psum"))
  ring = 2 * (N - 1) / N * 8 * 16 * 4
  got = sent_bytes(text)
  assert got == ring, (got, ring)
  windows = [w for w in schedule.windows(text) if w.kind != "slice"]
  scatter = {"tpu_v5e": ["all-to-all"], "tpu_v5p": ["collective-permute"] * (N - 1)}
  gather = ["all-gather"] if (name, _compat.ASYNC_CUSTOM_CALLS) == ("tpu_v5e", True) \
      else ["collective-permute"] * (N - 1)
  assert [w.kind for w in windows] == scatter[name] + gather, windows
  assert all(w.matmuls >= 1 for w in windows[:len(scatter[name])]), windows
  # (jax < 0.12 on v5p: libtpu 0.0.42.1 / 0.0.44.1 is outside the versions
  # the permute forms were measured on, said once; quirks.py.)
  assert not [m for m in warned if "outside the versions" not in m], warned


@needs_pairs
@pytest.mark.parametrize("kind", ["all_gather", "psum_scatter"])
def test_v5p_permute_parts_stay_apart_outside_program_order(kind):
  # Unfenced, XLA's CSE merged a gather's 7 permutes into one (one operand,
  # the permutation only in frontend attributes: every slot then came from
  # shift 7); each permute start now carries its config as its backend
  # config too (xla/futures.py, _to_custom_call_pair). 7 starts, 7 permutations.
  t = target("tpu_v5p")

  def f(x):
    return _start(kind, x).done()[None]
  fn = jax.shard_map(f, mesh=t.mesh, in_specs=P("x"), out_specs=P("x"))
  text, warned = _compile(fn, (arg(t, (64 * N, 16), P("x")),))
  starts = re.findall(r"collective-permute-start\(.*?source_target_pairs=(\{[^=]*\}),",
                      text)
  assert len(set(starts)) == N - 1, starts
  assert not warned, warned


@needs_pairs
@pytest.mark.subprocess
def test_the_form_needs_the_async_all_to_all_option():
  # Premise of the option the library sets (xla/compile_options.py):
  # with it off, libtpu dies on the form's all-to-all pair (run apart).
  target("tpu_v5e")
  out = compilers.compile_in_subprocess("""
      import tpu_forms_compiled_test as t
      t._compile(*t._future_program(target("tpu_v5e"), "psum_scatter"),
                 compiler_options={"xla_tpu_enable_async_all_to_all": False})
      print("compiled")
      """)
  assert out.returncode != 0 and "compiled" not in out.stdout, out.stderr[-2000:]


def _fsdp_program(t, weights, layers, **fsdp_kwargs):
  names = "ab"[:weights]

  def layer(x, p):
    for k in names:
      x = jnp.tanh(x @ p[k])
    return x

  def loss(x, ps):
    return jax_overlap.fsdp_scan(layer, x, ps, axis="x", **fsdp_kwargs).sum()[None]
  spec = {k: P(None, "x") for k in names}
  fwd = jax.shard_map(loss, mesh=t.mesh, in_specs=(P("x"), spec), out_specs=P("x"))
  f = jax.value_and_grad(lambda x, ps: fwd(x, ps).sum(), argnums=1)
  w = arg(t, (layers, 16, 16), P(None, "x"))
  return f, (arg(t, (64, 16), P("x")), {k: w for k in names})


def _scatter_windows(text):
  """The backward's reduce-scatters: their TPU form's all-to-all pairs."""
  return [w for w in schedule.windows(text) if w.kind == "all-to-all"]


REFUSED = "refused the program's schedule"


@needs_pairs
@pytest.mark.parametrize("weights,layers", [(1, 4), (2, 6)])
def test_fsdp_scan_backward_reduce_scatters_overlap_the_matmuls_on_tpu(
    weights, layers):
  # v5e: the forms are compiled async, each start tied after the previous
  # form's done (form_rewrites.chain_form_starts; without the ties libtpu refuses
  # 4 and 5 layers, where XLA unrolls the loop): each reduce-scatter but the
  # last has a matmul in flight, and the gathers still overlap.
  t = target("tpu_v5e")
  text, warned = _compile(*_fsdp_program(t, weights, layers))
  assert not any(REFUSED in m or "futures on tpu" in m for m in warned), warned
  assert not any("inside an ordered block" in m for m in warned), warned
  scatters = _scatter_windows(text)
  assert len(scatters) >= 2, scatters
  assert all(w.matmuls >= 1 for w in scatters[:-1]), scatters
  # Every gather has a matmul in flight but the forward pass's first: with
  # two weights a layer, layer 0 travels in two groups by use order
  # (patterns/fsdp/use_order.py) and the first group has nothing before it
  # in this program (no before=); with one weight layer 0 is one group.
  gathers = [w for w in schedule.windows(text) if w.kind == "all-gather"]
  assert gathers and sum(w.matmuls == 0 for w in gathers) <= 1, gathers
  assert sum(w.matmuls >= 1 for w in gathers) >= len(gathers) - 1, gathers


@needs_pairs
def test_fsdp_scan_backward_that_libtpu_refuses_compiles_again_with_its_forms_finished(
    monkeypatch):
  # Without the ties, libtpu refuses 4 layers ("kExceedsOverlapLimit" on an
  # all-to-all-done): the library then finishes each form where it starts
  # and compiles the module again (compile_options._finish_forms_when_refused),
  # and says so. The ties make this the fallback for what they miss.
  # fsdp_scan's steps finish their collectives before their results are
  # read (patterns/fsdp/transfer.py), which alone keeps libtpu within its
  # limit here: that fence is taken out too.
  from jax_overlap._src.xla import compile_options
  from jax_overlap._src.patterns.fsdp import transfer
  monkeypatch.setattr(compile_options, "_chain_forms", lambda computation: None)
  monkeypatch.setattr(transfer, "_DONE_BY_THE_END", (False, False))
  # Two layers a loop iteration (fsdp_scan's default before it ran one): the
  # module libtpu refuses.
  t = target("tpu_v5e")
  text, warned = _compile(*_fsdp_program(t, 1, 4, unroll=2))
  scatters = _scatter_windows(text)
  assert scatters and all(w.matmuls == 0 for w in scatters), scatters
  assert sum(REFUSED in m for m in warned) == 1, warned
  # The gathers are untouched: every layer's but the first of each pass
  # (a loop body's windows counted once an iteration).
  gathers = schedule.runs(text, [w for w in schedule.windows(text)
                                 if w.kind == "all-gather"])
  assert sum(w.matmuls >= 1 for w in gathers) >= 2 * 3 - 1, gathers


@needs_pairs
@pytest.mark.parametrize("weights,layers", [(1, 2), (2, 3), (1, 4), (2, 6)])
def test_fsdp_scan_backward_on_v5p_keeps_its_permutes_in_flight(weights, layers):
  # On v5p libtpu 0.0.52 aborted the process on fsdp_scan's backward over 2
  # or 3 layers with the all-to-all forms async ("Check failed" in copy
  # insertion); the gathers and reduce-scatters are now permutes
  # (collectives/permute_forms.py): the module compiles with them async,
  # nothing is said, every gather but one has a matmul in flight (the
  # forward's first), and each reduce-scatter but the last (6 layers: a
  # loop's body counted once).
  t = target("tpu_v5p")
  text, warned = _compile(*_fsdp_program(t, weights, layers))
  assert not warned, warned
  futures = schedule.permute_futures(text)
  scatters = [f for f in futures if not f.is_gather]
  gathers = [f for f in futures if f.is_gather]
  assert sum(f.matmuls == 0 for f in gathers) <= 1, gathers
  assert len(scatters) >= 3 if layers > 2 else len(scatters) == 2, scatters
  # (One weight over 4 layers: 2 of 3 until the modules holding permutes got
  # libtpu's experimental scheduler features, xla/compile_options.py.)
  got = sum(f.matmuls >= 1 for f in scatters)
  assert got >= len(scatters) - 1, scatters


@needs_pairs
def test_several_all_to_all_forms_on_v5p_are_finished_at_once():
  # What is still finished at once on v5p (compile_options.py): several
  # futures whose form is an all-to-all (all_to_all_start here, one after
  # the other; psum_start there is permutes, ring_psum.py) in one module;
  # said, and compiled.
  t = target("tpu_v5p")

  @program_order(enforce=True)
  def body(x, w):
    a = jax_overlap.all_to_all_start(x, "x", 0, 0, tiled=True)
    w = jnp.tanh(w @ w)
    a = a.done()
    b = jax_overlap.all_to_all_start(a * 2, "x", 0, 0, tiled=True)
    w = jnp.tanh(w @ w)
    return b.done(), w

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  fn = jax.shard_map(f, mesh=t.mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  text, warned = _compile(fn, (arg(t, (64, 16), P("x")), arg(t, (16, 16))))
  assert not any(w.matmuls for w in schedule.windows(text)
                 if w.kind == "all-to-all"), schedule.windows(text)
  assert any("aborts on some programs" in m for m in warned), warned


def _sum_beside_two_matmuls(to):
  """An ordered block: psum_start(x, "x", to=to), two matmuls, done()."""
  @program_order(enforce=True)
  def body(x, w):
    future = jax_overlap.psum_start(x, "x", to=to)
    y = jnp.tanh(w @ w)
    y = jnp.tanh(y @ w)
    return future.done(), y
  return body


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
def test_psum_start_ring_halves_each_hide_behind_a_matmul(name):
  # Two matmuls written between psum_start and done(): the reduce-scatter
  # half (v5e: an all-to-all; v5p: 7 permutes) is in flight across the
  # first, the all-gather half (v5e: an all-gather; v5p: 7 permutes, moved
  # up together into the window, ring_psum.advance_second_halves) across the
  # second. Without the move the all-gather starts at done(), its window
  # empty.
  t = target(name)
  body = _sum_beside_two_matmuls("invarying")

  def f(x, w):
    a, y = body(x, w)
    return (a.sum() + y.sum())[None]
  fn = jax.shard_map(f, mesh=t.mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  text, warned = _compile(fn, (arg(t, (64, 16), P("x")), arg(t, (16, 16))))
  windows = [w for w in schedule.windows(text) if w.kind != "slice"]
  halves = {"tpu_v5e": [("all-to-all", 1), ("all-gather", 1)],
            "tpu_v5p": [("collective-permute", 1)] * (2 * (N - 1))}
  assert [(w.kind, w.matmuls) for w in windows] == halves[name], windows
  assert sent_bytes(text) == 2 * (N - 1) / N * 8 * 16 * 4
  assert not warned, warned


@needs_pairs
@pytest.mark.parametrize("name", ["tpu_v5e", "tpu_v5p"])
def test_varying_psum_backward_halves_are_async(name):
  # psum_start(to="varying") under value_and_grad, two matmuls in the
  # window: the forward's halves each behind one, as above, and the
  # cotangent's sum too (its transpose, transposed_forms.py): on v5e the
  # reduce-scatter half in its TPU form (an all-to-all whose buffer rides in
  # the forward all-gather's in-flight slot) and the all-gather half (the
  # forward all-gather is its form there, an all-to-all of copies, for that
  # buffer); on v5p 2 x 7 permutes each way. Nothing synchronous, nothing
  # said: a plain psum_start with the cast after it leaves the cotangent's
  # sum a synchronous all-reduce.
  t = target(name)
  body = _sum_beside_two_matmuls("varying")

  def f(x, w, r):
    a, y = body(x, w)
    return jax.lax.psum(jnp.sum(jnp.tanh(a + r)) + y.sum(), "x")
  fn = jax.value_and_grad(jax.shard_map(
      f, mesh=t.mesh, in_specs=(P("x"), P(), P("x")), out_specs=P()),
      argnums=(0, 1))
  text, warned = _compile(fn, (arg(t, (64, 16), P("x")), arg(t, (16, 16)),
                               arg(t, (64, 16), P("x"))))
  windows = [(w.kind, w.matmuls > 0) for w in schedule.windows(text)
             if w.kind != "slice"]
  halves = {"tpu_v5e": [("all-to-all", True), ("all-to-all", True),
                        ("all-to-all", True), ("all-gather", True)],
            "tpu_v5p": [("collective-permute", True)] * (4 * (N - 1))}
  assert windows == halves[name], windows
  assert not re.search(r"= [^\n]*\ball-reduce\([^\n]*op_name=\"[^\"]*collective",
                       text)
  assert not warned, warned
