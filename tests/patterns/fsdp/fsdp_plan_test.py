"""`fsdp_scan`'s plan (src/jax_overlap/_src/patterns/fsdp/plan.py) and its one
executor (engine.py).

Every combination of the settings is planned or refused with an error that
names the setting; every plan moves each layer exactly as the schedule says
(gathered once before its forward step, regathered once unless kept,
reduce-scattered once after its backward step, with HSDP all-reduced once
after that); the plan prints as a table; `fsdp_scan` runs the plan
`jax_overlap.fsdp_plan` shows; and `before=`/`after=` run with any memory
knob (which the two engines before this one refused), equal to `lax.scan`.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap._src.patterns.fsdp import engine
from jax_overlap._src.patterns.fsdp.plan import plan
from jax_overlap._src.patterns.fsdp.plan_steps import RUN_KINDS

pytestmark = pytest.mark.newest_jax(older_jax=[
    "test_every_combination_is_planned_or_refused_by_name",
    "test_the_plan_prints_as_a_table",
    "test_the_executor_runs_every_kind_of_run",
    "test_unroll_is_planned",
    "test_the_table_names_its_columns",
    "test_fsdp_scan_runs_the_plan_fsdp_plan_shows",
])

GOOD = {
    "n_layers": [1, 2, 3, 5],
    "prefetch": [1, 2, 4],
    "reshard_after_forward": [True, False, 0, 1, 2],
    "futures": [True, False],
    "hsdp": [False, True],
    "bucket": [True, False],
    "before": [False, True],
    "after": [False, True],
    "has_ys": [False, True],
    "split": [True, False],
    "moves": [True, False],
}
#: Values each setting refuses, and the words its error names it by.
BAD = {
    "n_layers": ([0, -1, 2.0, True], "fsdp_plan(n_layers=...)"),
    "prefetch": ([0, -2, 1.5, True, "2"], "fsdp_scan(prefetch=...)"),
    "reshard_after_forward": ([-1, 6, 1.5, "1", None],
                              "fsdp_scan(reshard_after_forward=...)"),
    "futures": ([1, None], "fsdp_scan(futures=...)"),
    "hsdp": (["r", 0], "fsdp_scan(hsdp=...)"),
    "bucket": (["auto", 1], "fsdp_scan(bucket=...)"),
    "before": ([print, 1], "fsdp_scan(before=...)"),
    "after": ([0, "y"], "fsdp_scan(after=...)"),
    "has_ys": ([1, None], "fsdp_scan(has_ys=...)"),
    "split": ([None], "fsdp_scan(split=...)"),
}


def _check(p, kw):
  """The schedule's invariants on plan `p` made from settings `kw`."""
  n, k = kw["n_layers"], p.kept
  depth = p.prefetch
  regathered = n - k
  assert 1 <= depth <= max(1, n - 1) and 0 <= k <= n
  # each layer computed once in each pass, in order
  fwd = [s for s in p.forward if "layer" in s.compute]
  bwd = [s for s in p.backward if "layer_back" in s.compute]
  assert [s.layer for s in fwd] == list(range(n))
  assert [s.layer for s in bwd] == list(range(n - 1, -1, -1))
  # forward: every layer gathered once, before its step, at most p ahead
  gathered = {}
  for pos, s in enumerate(p.forward):
    for g in s.gathers:
      assert g not in gathered
      gathered[g] = pos
  assert sorted(gathered) == list(range(n))
  at = {s.layer: pos for pos, s in enumerate(p.forward) if s.layer is not None}
  assert all(gathered[g] <= at[g] for g in gathered)
  assert all(at[g] - gathered[g] <= depth for g in gathered if g)
  # the last k keep their weights; the kept are never regathered
  assert [s.layer for s in fwd if s.keeps] == list(range(n - k, n))
  regather = {}
  for pos, s in enumerate(p.backward):
    for g in s.gathers:
      assert g not in regather
      regather[g] = pos
  assert sorted(regather) == list(range(regathered))
  at = {s.layer: pos for pos, s in enumerate(p.backward) if s.layer is not None}
  assert all(regather[g] < at[g] for g in regather)
  assert [s.weights for s in bwd] == ["kept" if s.layer >= regathered
                                      else "gathered" for s in bwd]
  assert max(s.buffered for s in bwd) <= depth
  # each gradient reduce-scattered once, after its step; HSDP: all-reduced
  # once, after its reduce-scatter; none on an explicit mesh
  scattered = {}
  reduced = {}
  for pos, s in enumerate(p.backward):
    for g in s.scatters:
      assert g not in scattered
      scattered[g] = pos
    if s.reduce is not None:
      assert s.reduce not in reduced
      reduced[s.reduce] = pos
  assert sorted(scattered) == list(range(n))
  assert all(scattered[g] >= at[g] for g in scattered)
  hsdp = kw["hsdp"] and kw["futures"]
  assert p.stages == (2 if hsdp else 1)
  assert sorted(reduced) == (list(range(n)) if hsdp else [])
  assert all(reduced[g] > scattered[g] for g in reduced if g)
  # the ends, the split and the fences where the settings say
  assert (p.forward[0].compute.startswith("before")) == kw["before"]
  assert (p.forward[-1].compute == "after") == kw["after"]
  assert (p.backward[0].compute == "after_back") == kw["after"]
  assert any("before_back" in s.compute for s in p.backward) == kw["before"]
  default_shape = k <= 1 and depth == 1
  split = (kw["split"] and kw["futures"] and kw["moves"] and n >= 2
           and default_shape)
  assert p.forward[0].split == split
  assert bwd[-1].split == (split and not hsdp)
  assert p.fence_inputs == (not default_shape)
  # the last layer in the loops where the default schedule runs in shard_map
  # with one stage and a loop of middle layers to join (3 layers or more):
  # its forward step regathers it (the kept copy), its backward step
  # reduce-scatters zeros; over one device also layer 0's backward step,
  # which regathers layer 0; none in gathers / scatters
  fold = kw["futures"] and default_shape and k == 1 and not hsdp and n >= 3
  again = [s for s in p.steps if s.again]
  assert [(s.compute, s.layer) for s in again] == (
      [("layer", n - 1), ("layer_back", n - 1)] if fold else []) + (
      [("layer_back", 0)] if fold and not kw["moves"] else [])
  assert all(s.loop for s in again) and all(s.keeps for s in again[:1])
  # every step is in the table, and the notes say why where nothing split
  text = str(p)
  assert len(text.splitlines()) >= len(p.steps) + 3
  if kw["split"] and not split:
    assert any("not split" in note for note in p.notes)
  _check_runs(p, n, fold)


_LAYER_RUNS = ("layers", "layers_back", "enter_split", "back_split")


def _check_runs(p, n, fold):
  """The executor's runs: each pass (and each split run's `otherwise`,
  which replaces it and the runs after it) runs every layer once, in
  order, by kinds the executor has, each run's fields as its steps say."""
  kinds = {"forward": engine._FORWARD, "primal": engine._FORWARD,
           "backward": engine._BACKWARD}
  for name, want in (("forward", range(n)), ("primal", range(n)),
                     ("backward", range(n - 1, -1, -1))):
    runs = p.runs[name]
    for runs in [runs] + [runs[:k] + r.otherwise
                          for k, r in enumerate(runs) if r.otherwise]:
      assert all(r.kind in kinds[name] for r in runs), runs
      assert [s.layer for r in runs if r.kind in _LAYER_RUNS
              for s in r.steps] == list(want), (name, runs)
      assert runs[0].kind == ("leave_back" if name == "backward" else
                              "enter" if not runs[0].otherwise else
                              "enter_split")
      assert runs[-1].kind in (("enter_back", "back_split")
                               if name == "backward" else ("leave",))
      for r in runs:
        assert not r.loop or r.kind in ("layers", "layers_back")
        assert not r.stacks or (r.loop and name == "forward")
        assert r.clamp == (r.kind == "layers" and fold and (
                               name == "forward" or not p.moves)
                           or r.kind == "layers_back" and any(
                               s.again and s.layer == 0 for s in r.steps))
        for s in r.steps if r.kind in ("layers", "layers_back") else ():
          if not s.again:
            assert tuple(g - s.layer for g in s.gathers) == r.gathers, (r, s)
          if r.kind == "layers":
            assert r.keep == (name == "forward" and s.keeps and not s.again)
          else:
            assert r.kept == (s.weights == "kept" and not s.again)
            assert r.pending == (1 if s.again else (s.layer + 1 in s.scatters)
                                 + (s.reduce is not None))


def test_the_executor_runs_every_kind_of_run():
  assert set(engine._FORWARD) | set(engine._BACKWARD) == set(RUN_KINDS)
  assert not set(engine._FORWARD) & set(engine._BACKWARD)


def test_unroll_is_planned():
  # None: one layer an iteration, p with prefetch p; rounded up to a
  # multiple of p (plan.loop_unroll); refused by name.
  assert [jo.fsdp_plan(6, prefetch=p, unroll=u).unroll
          for p, u in [(1, None), (2, None), (1, 3), (2, 3), (3, 4)]] == \
      [1, 2, 3, 4, 6]
  for bad in (0, True, 1.5):
    with pytest.raises(ValueError, match=r"fsdp_scan\(unroll=\.\.\.\)"):
      jo.fsdp_plan(4, unroll=bad)


def test_every_combination_is_planned_or_refused_by_name():
  planned = refused = 0
  for values in itertools.product(*GOOD.values()):
    kw = dict(zip(GOOD, values))
    keep = kw["reshard_after_forward"]
    if not isinstance(keep, bool) and keep > kw["n_layers"]:
      # more layers to keep than the stack has: the one refusal in the grid
      with pytest.raises(ValueError, match=r"fsdp_scan\(reshard_after_forward"
                         r"=\.\.\.\).*an int from 0 to the number of layers"):
        plan(**kw)
      refused += 1
      continue
    _check(plan(**kw), kw)
    planned += 1
  assert planned + refused == 4 * 3 * 5 * 2 ** 8 and refused == 3 * 2 ** 8  # n=1 with 2 kept, each prefetch
  base = {name: options[0] for name, options in GOOD.items()}
  for name, (values, words) in BAD.items():
    for value in values:
      kw = dict(base, **{name: value})
      with pytest.raises((ValueError, TypeError)) as info:
        plan(**kw)
      assert words in str(info.value), (name, value, str(info.value))


#: Printed plans, pinned: the default schedule with both ends (layer 0
#: split by use, the last layer's steps in the loops), a fenced one
#: (prefetch 2, every layer regathered, one collective a leaf) and HSDP.
PRINTED = {
    "default-ends": (dict(before=lambda t: t, after=lambda y: y), """\
fsdp_scan plan: 3 layers, prefetch=1, 1 kept for the backward pass, unroll=1, futures inside jax.shard_map
pass      #  computes                                                   gathers  reduce-scatters  all-reduces  weights   keeps  loop
--------  -  ---------------------------------------------------------  -------  ---------------  -----------  --------  -----  ----
forward   0  before(x), then layer 0 [split by use]                     0, 1     -                -            gathered  -      -
forward   1  layer 1                                                    2        -                -            gathered  -      yes
forward   2  layer 2                                                    2 again  -                -            gathered  yes    yes
forward   3  after(y)                                                   -        -                -            -         -      -
backward  0  after's backward                                           -        -                -            -         -      -
backward  1  layer 2's backward                                         1        zeros            -            kept      -      yes
backward  2  layer 1's backward                                         0        2                -            gathered  -      yes
backward  3  layer 0's backward, then before's backward [split by use]  -        1, 0             -            gathered  -      -
runs (primal: without a gradient):
  forward: enter_split 0 | layers 1-2 (one loop; gathers +1; gathers clamped to the last layer; residuals into carried stacks) | leave 3 (keeps the last layer's copy gathered again)
    one group: enter 0 | layers 0-2 (one loop; gathers +1; gathers clamped to the last layer; residuals into carried stacks) | leave 3 (keeps the last layer's copy gathered again)
  primal: enter_split 0 | layers 1 (one loop; gathers +1) | layers 2 | leave 3
    one group: enter 0 | layers 0-1 (one loop; gathers +1) | layers 2 | leave 3
  backward: leave_back 0 | layers_back 1-2 (one loop; gathers -1; first from the copy gathered again, a zero gradient pending; finishes the step before's reduce-scatter) | back_split 3
    one group: layers_back 3 (finishes the step before's reduce-scatter) | enter_back 3
notes:
  - layer 0's gathers and its gradient's reduce-scatters travel in groups by first use, where the traced layer gives two or more groups; else as one transfer.
  - bucket: each transfer moves all of a layer's sharded leaves of one dtype in one collective.
  - layer 2 runs in the loops: its forward step gathers it again (the copy the backward pass keeps), its backward step reduce-scatters a zero gradient (one copy of the layer a pass in the compiled program)."""),
    "fenced": (dict(prefetch=2, reshard_after_forward=True, bucket=False), """\
fsdp_scan plan: 3 layers, prefetch=2, 0 kept for the backward pass, unroll=2, futures inside jax.shard_map
pass      #  computes                       gathers  reduce-scatters  all-reduces  weights   keeps  loop
--------  -  -----------------------------  -------  ---------------  -----------  --------  -----  ----
forward   0  (nothing: waited for at once)  0        -                -            -         -      -
forward   1  layer 0                        1, 2     -                -            gathered  -      -
forward   2  layer 1                        -        -                -            gathered  -      -
forward   3  layer 2                        -        -                -            gathered  -      -
backward  0  (nothing: waited for at once)  2        -                -            -         -      -
backward  1  layer 2's backward             1, 0     -                -            gathered  -      -
backward  2  layer 1's backward             -        2                -            gathered  -      -
backward  3  layer 0's backward             -        1                -            gathered  -      -
backward  4  (nothing: waited for at once)  -        0                -            -         -      -
runs (primal: without a gradient):
  forward: enter 0 | layers 1 (gathers +1, +2) | layers 2 | layers 3 | leave
  primal: enter 0 | layers 1 (gathers +1, +2) | layers 2 | layers 3 | leave
  backward: leave_back 0 (gathers 2) | layers_back 1 (gathers -1, -2) | layers_back 2 (finishes the step before's reduce-scatter) | layers_back 3 (finishes the step before's reduce-scatter) | enter_back 4
notes:
  - layer 0 is not split by use order: planned with prefetch=1 and reshard_after_forward True or 1 only (the schedule measured on the real compilers).
  - bucket=False: one collective per sharded leaf.
  - each layer step's inputs are fenced before it starts (this schedule holds several gathered layers)."""),
    "hsdp-after": (dict(replica_axis="r", after=True), """\
fsdp_scan plan: 3 layers, prefetch=1, 1 kept for the backward pass, unroll=1, futures inside jax.shard_map, HSDP
pass      #  computes                       gathers  reduce-scatters  all-reduces  weights   keeps  loop
--------  -  -----------------------------  -------  ---------------  -----------  --------  -----  ----
forward   0  layer 0 [split by use]         0, 1     -                -            gathered  -      -
forward   1  layer 1                        2        -                -            gathered  -      yes
forward   2  layer 2                        -        -                -            gathered  yes    -
forward   3  after(y)                       -        -                -            -         -      -
backward  0  after's backward               -        -                -            -         -      -
backward  1  layer 2's backward             1        -                -            kept      -      -
backward  2  layer 1's backward             0        2                -            gathered  -      -
backward  3  layer 0's backward             -        1                2            gathered  -      -
backward  4  (nothing: waited for at once)  -        -                1            -         -      -
backward  5  (nothing: waited for at once)  -        0                0            -         -      -
runs (primal: without a gradient):
  forward: enter_split 0 | layers 1 (one loop; gathers +1; residuals into carried stacks) | layers 2 (keeps its weights) | leave 3
    one group: enter 0 | layers 0-1 (one loop; gathers +1; residuals into carried stacks) | layers 2 (keeps its weights) | leave 3
  primal: enter_split 0 | layers 1 (one loop; gathers +1) | layers 2 | leave 3
    one group: enter 0 | layers 0-1 (one loop; gathers +1) | layers 2 | leave 3
  backward: leave_back 0 | layers_back 1 (gathers -1; kept weights) | layers_back 2 (gathers -1; finishes the step before's reduce-scatter) | layers_back 3 (finishes the step before's reduce-scatter and all-reduce) | reduce 4 | enter_back 5
notes:
  - layer 0's gathers travel in groups by first use, where the traced layer gives two or more groups; else as one transfer.
  - with HSDP layer 0's gradient travels as one reduce-scatter, then one all-reduce (not split).
  - HSDP: each layer's gradient is reduce-scattered over the fsdp axis, then all-reduced over the replicas one step later.
  - bucket: each transfer moves all of a layer's sharded leaves of one dtype in one collective."""),
}


@pytest.mark.parametrize("name", list(PRINTED))
def test_the_plan_prints_as_a_table(name):
  kw, text = PRINTED[name]
  assert str(jo.fsdp_plan(3, **kw)) == text


def test_the_table_names_its_columns():
  hsdp = jo.fsdp_plan(4, prefetch=2, reshard_after_forward=2,
                      replica_axis="r")
  rows = hsdp.table().splitlines()
  assert rows[0].split()[:3] == ["pass", "#", "computes"]
  assert "layer 1's backward" in rows[-4] and rows[-4].split()[-5:-3] == \
      ["2", "3"]   # layer 1's step reduce-scatters layer 2, all-reduces 3
  assert "prefetch=2" in str(hsdp) and "HSDP" in str(hsdp)
  assert any("not split by use order" in n for n in hsdp.notes)
  assert repr(hsdp) == "FsdpPlan(n_layers=4, prefetch=2, kept=2, steps=11)"


def test_the_default_program_holds_the_layer_once_a_loop():
  # The default schedule's loops run every layer but layer 0 (split by use
  # order) in each pass, one layer an iteration: the lowered gradient step
  # holds 4 copies of the layer (layer 0 and the loop, each pass), so 2
  # matmuls forward and 4 backward each: 12 dot_generals. unroll=2 holds 4
  # copies a pass (layer 0, the loop's 2 and the odd trip run before it):
  # 24, as many as the former default (unroll=2, the last layer apart).
  loss, _, args = _model(4, {}, ends=False)
  text = loss.lower(*args).as_text()
  assert text.count("stablehlo.dot_general") == 12, \
      text.count("stablehlo.dot_general")
  unrolled, _, _ = _model(4, dict(unroll=2), ends=False)
  assert unrolled.lower(*args).as_text().count("stablehlo.dot_general") == 24


def _model(n, kw, ends):
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params = {"a": jax.random.normal(k1, (n, 8, 8)) * 0.3,
            "b": jax.random.normal(k2, (n, 8, 8)) * 0.3}
  table = jnp.linspace(-1.0, 1.0, 40).reshape(5, 8)
  tokens = jnp.arange(8) % 5
  layer = lambda x, w: x + jnp.tanh(x @ w["a"]) @ w["b"]
  mesh = jax.make_mesh((2, 2), ("r", "d"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  @jax.jit
  @functools.partial(jax.value_and_grad, argnums=(0, 1))
  @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "d"), P(("r", "d"))),
                 out_specs=P())
  def loss(table, ws, tokens):
    if ends:
      return lax.pmean(jo.fsdp_scan(
          layer, tokens, ws, axis="d", before=lambda t: table[t],
          after=lambda y: jnp.mean(y ** 2), **kw), ("r", "d"))
    y = jo.fsdp_scan(layer, table[tokens], ws, axis="d", **kw)
    return lax.pmean(jnp.mean(y ** 2), ("r", "d"))

  def ref(table, ws, tokens):
    y, _ = lax.scan(lambda x, w: (layer(x, w), None), table[tokens], ws)
    return jnp.mean(y ** 2)
  args = (table, params, tokens)
  return loss, jax.jit(jax.value_and_grad(ref, argnums=(0, 1))), args


def test_fsdp_scan_runs_the_plan_fsdp_plan_shows(monkeypatch):
  seen = []
  run = engine.run
  monkeypatch.setattr(engine, "run", lambda p, *a, **k: (seen.append(p),
                                                          run(p, *a, **k))[1])
  kw = dict(prefetch=2, reshard_after_forward=2, replica_axis="r")
  loss, _, args = _model(4, kw, ends=True)
  jax.eval_shape(loss, *args)
  want = jo.fsdp_plan(4, before=True, after=True, **kw)
  assert [str(p) for p in seen] == [str(want)]


@pytest.mark.parametrize("kw", [
    dict(reshard_after_forward=2),
    dict(prefetch=2, reshard_after_forward=True),
    dict(prefetch=3, reshard_after_forward=False),
    dict(prefetch=2, reshard_after_forward=2, replica_axis="r"),
], ids=["keep-2", "prefetch-2", "prefetch-3-keep-all", "hsdp-keep-2-prefetch-2"])
def test_ends_run_with_every_memory_knob(kw):
  # Refused by the engines before this one ("fsdp-ends-kept" in
  # docs/misuse.md); now the same steps with before's and after's in them.
  loss, ref, args = _model(4, kw, ends=True)
  (got, got_grads), (want, want_grads) = loss(*args), ref(*args[:2], args[2])
  assert jnp.allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert jnp.allclose(g, w, rtol=1e-4, atol=1e-6)
