"""pipeline_schedule: the tables' invariants, their bubble and memory."""

import itertools

import pytest

import jax_overlap._src.patterns.pipeline.placing as plan_lib
from jax_overlap._src.patterns.pipeline.actions import (B, F, I, W, Pair,
                                                       device_chunk,
                                                       global_stage, parts)

pipeline_schedule = plan_lib.pipeline_schedule


def _cases():
  for p, k, send in itertools.product((2, 3, 4), (1, 2, 3), (0, 1, None)):
    m = k * p
    yield "gpipe", p, m, 1, send
    yield "1f1b", p, m, 1, send
    yield "zb-h1", p, m, 1, send
    yield "zb-v", p, m, 2, send
    if k >= 2:
      yield "dualpipev", p, m, 2, send
    for v in (2, 3):
      yield "interleaved", p, m, v, send


CASES = list(_cases())


def _placed(plan):
  """(kind, microbatch, global stage) -> (tick, device)."""
  at = {}
  for t, row in enumerate(plan.table):
    for d, cell in enumerate(row):
      for a in parts(cell):
        key = (a.kind, a.microbatch,
               global_stage(d, a.chunk, plan.stages, plan.placement))
        assert key not in at, f"{key} twice"
        at[key] = (t, d)
  return at


@pytest.mark.parametrize("schedule,p,m,v,send", CASES)
def test_every_action_once_and_after_its_inputs(schedule, p, m, v, send):
  plan = pipeline_schedule(schedule, p, m, v, send_ticks=send)
  send = plan.send_ticks or 0
  at = _placed(plan)
  stages = p * v
  zero_bubble = schedule in ("zb-h1", "zb-v")
  back = I if zero_bubble else B
  kinds = (F, I, W) if zero_bubble else (F, B)
  if schedule != "dualpipev":   # its backwards: some B, some I and W
    assert len(at) == len(kinds) * m * stages
  for i, g in itertools.product(range(m), range(stages)):
    if schedule == "dualpipev":
      zero_bubble = (I, i, g) in at
      back = I if zero_bubble else B
      assert ((B, i, g) in at) != zero_bubble and ((W, i, g) in at) == zero_bubble
    tf, df = at[F, i, g]
    tb, db = at[back, i, g]
    assert df == db == device_chunk(g, p, plan.placement)[0]
    assert tf < tb                                   # F before its B / I
    if zero_bubble:
      assert at[W, i, g][0] > tb and at[W, i, g][1] == db   # I before W
    # after the stage before (F) / after (B, I); a send unless the stage is
    # on the same device (ZB-V's turn)
    if g > 0:
      tp_, dp_ = at[F, i, g - 1]
      assert tp_ + 1 + (send if dp_ != df else 0) <= tf
    if g < stages - 1:
      # the next stage's backward: a B or (zero bubble) an I
      tn, dn = at[I if (I, i, g + 1) in at else B, i, g + 1]
      assert tn + 1 + (send if dn != db else 0) <= tb


@pytest.mark.parametrize("p,k", list(itertools.product((2, 3, 4, 8), (1, 2, 3, 4))))
def test_bubble_fractions_are_the_literatures(p, k):
  """The literature's tables (send_ticks=0), and the default tables of 1F1B
  and interleaved, which keep their bubble with one kind of action a tick."""
  m = k * p
  for schedule in ("gpipe", "1f1b"):
    sim = pipeline_schedule(schedule, p, m, send_ticks=0).simulate()
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
  sim = pipeline_schedule("1f1b", p, m).simulate()
  assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
  for v in (2, 3, 4):
    for send in (0, None):
      sim = pipeline_schedule("interleaved", p, m, v, send_ticks=send).simulate()
      assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1),
                                                  abs=1e-12)
  zb = pipeline_schedule("zb-h1", p, m, send_ticks=0).simulate().bubble_fraction
  assert zb <= (p - 1) / (3 * m + p - 1) + 1e-12
  assert zb < pipeline_schedule("1f1b", p, m, send_ticks=0).simulate().bubble_fraction


@pytest.mark.parametrize("p,k", list(itertools.product((2, 3, 4, 8), (1, 2, 3, 4))))
def test_zero_bubble_default_table_runs_at_the_formula(p, k):
  """ZB-H1's default table (what pipeline_loss runs: every send a tick in
  flight, the warm-ups lengthened for it) keeps the paper's bubble
  (p-1)/(3m+p-1) where sends are free, and where a send costs a tenth of a
  forward it is no worse than the paper's own table, whose sends are all on
  the critical path (4 stages, 8 microbatches: 0.121 against 0.149)."""
  m = k * p
  default = pipeline_schedule("zb-h1", p, m)
  paper = pipeline_schedule("zb-h1", p, m, send_ticks=0)
  assert default.simulate(send=0).bubble_fraction == pytest.approx(
      (p - 1) / (3 * m + p - 1), abs=1e-12)
  assert (default.simulate(send=0.1).bubble_fraction
          <= paper.simulate(send=0.1).bubble_fraction + 1e-12)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2),
                                        ("interleaved", 3)])
@pytest.mark.parametrize("p,k", list(itertools.product((2, 3, 4, 8), (1, 2, 4))))
def test_the_default_table_has_one_kind_a_tick(schedule, v, p, k):
  """What pipeline_loss runs: no tick mixes kinds (lockstep runs it at no
  cost), 1F1B in the literature's 2 (m+p-1) ticks."""
  plan = pipeline_schedule(schedule, p, k * p, v)
  assert plan.send_ticks is None
  assert all(len({a.kind for a in row if a}) <= 1 for row in plan.table)
  if schedule == "1f1b":
    assert plan.ticks == 2 * (k * p + p - 1)


@pytest.mark.parametrize("p,m", [(2, 6), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_peak_activations(p, m):
  one_f_one_b = pipeline_schedule("1f1b", p, m, send_ticks=0).simulate().peak_activations
  assert one_f_one_b == tuple(p - d for d in range(p))
  # alternating ticks: a forward and a backward a pair of ticks, so a
  # microbatch's round trip from stage d holds 2 (p-1-d) + 1 (at most m)
  default = pipeline_schedule("1f1b", p, m).simulate().peak_activations
  assert default == tuple(min(m, 2 * (p - 1 - d) + 1) for d in range(p))
  assert pipeline_schedule("gpipe", p, m).simulate().peak_activations == (m,) * p
  assert max(pipeline_schedule("zb-h1", p, m, send_ticks=0).simulate()
             .peak_activations) <= p


@pytest.mark.parametrize("p,k", list(itertools.product((2, 3, 4, 8), (2, 3, 4))))
def test_zb_v_bubble_and_peak(p, k):
  """ZB-V under unit costs (a chunk's F, I and W each 1), m >= 2p. The
  literature's table (send_ticks=0): every device runs its 6m chunk actions
  and device p-1 cannot start before tick p-1, so the makespan is at least
  6m+p-1 and the bubble at least (p-1)/(6m+p-1); the table reaches that
  bound (p=4, m=8: 0.0588, 51 ticks), below ZB-H1's (p-1)/(3m+p-1) (0.111)
  and 1F1B's (0.273), holding 2p chunk-microbatches a device, 1F1B's p
  stage-microbatches. The default table (a tick a send): device p-1 cannot
  start before tick 2(p-1), so at least 6m+2(p-1) ticks; the table has
  exactly that many (p=4, m=8: 54, was 57), `simulate()` (a send a tick)
  gives that makespan and the bubble (p-1)/(3m+p-1), and with free sends
  it is the literature's table's 6m+p-1; its peak, 2(2p-1) chunks, is twice
  1F1B's default's 2p-1 stage inputs, and no less can reach the bound:
  device p-1's first I comes 4(p-1)+2 ticks after its first forward."""
  m = k * p
  sim = lambda s, v=1, send=0: pipeline_schedule(s, p, m, v, send_ticks=send
                                                 ).simulate(send=0)
  zbv = sim("zb-v", 2)
  assert zbv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
  assert zbv.makespan == 6 * m + p - 1
  assert zbv.bubble_fraction < sim("zb-h1").bubble_fraction < sim("1f1b").bubble_fraction
  assert zbv.peak_activations == (2 * p,) * p
  assert max(zbv.peak_activations) == 2 * max(sim("1f1b").peak_activations)
  plan = pipeline_schedule("zb-v", p, m, 2)
  assert plan.send_ticks == 1
  assert plan.ticks == 6 * m + 2 * (p - 1)
  default = plan.simulate()
  assert default.makespan == plan.ticks
  assert default.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
  assert plan.simulate(send=0).makespan == 6 * m + p - 1
  assert default.peak_activations == (2 * (2 * p - 1),) * p
  assert max(default.peak_activations) == 2 * max(sim("1f1b", 1, None).peak_activations)
  assert (plan.simulate(send=0.1).bubble_fraction
          < pipeline_schedule("zb-h1", p, m).simulate(send=0.1).bubble_fraction)


@pytest.mark.parametrize("send", [0, 1])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_ticks_are_the_least_for_every_m(p, send):
  """For every m >= p, a send 0 or 1 tick: 6m + (1+s)(p-1) ticks (device
  p-1 starts at tick (1+s)(p-1) and runs 6m actions), plus what device p-1
  must idle where m is too small to fill its warm-up: only forwards can run
  there until its first I, 2(1+s)(p-1)+2 ticks in, and there are 2m of them.
  No shorter table exists, and none holds more than the cap."""
  h = 1 + send
  for m in range(p, 4 * p + 1):
    plan = pipeline_schedule("zb-v", p, m, 2, send_ticks=send)
    assert plan.ticks == 6 * m + h * (p - 1) + max(0, 2 * (h * (p - 1) + 1 - m))
    assert max(plan.simulate().peak_activations) <= 2 * min(m, h * (p - 1) + 1)


def test_zb_v_print_and_placement():
  """Device 0 holds the first and the last stage: its chunk 1 runs the
  loss-side stage, and microbatch 0's forward turns on device p-1."""
  plan = pipeline_schedule("zb-v", 2, 2, 2, send_ticks=0)
  assert plan.placement == "v"
  assert str(plan).splitlines()[:5] == [
      "tick  stage 0  stage 1",
      "   0  F0       .",
      "   1  F1       F0",
      "   2  .        F0.1",
      "   3  F0.1     F1",
  ]


@pytest.mark.parametrize("p,k", list(itertools.product((2, 4, 8), (2, 3))))
def test_dualpipev_ticks_bubble_and_peak(p, k):
  """DualPipeV under unit costs (a chunk's F, I and W each 1, an F&B cell
  its parts' sum: no overlap credited), sends free, m = 2p, 3p. The
  send_ticks=0 table is 2m+5p-2 ticks; the makespan 6m+2(p-1): each device
  idles 2(p-1), the DualPipe README's (PP/2-1)(F&B+B-3W) with PP = 2p
  stages, F&B = 3, B = 2, W = 1; the bubble (p-1)/(3m+p-1) (ZB-H1's
  formula in chunk units), p-1 more than ZB-V's 6m+p-1 at the same p, m
  (p=4, m=8: 54 against 51, 0.111 against 0.0588); the peak 2p+1
  chunk-microbatches a device (the README's PP+1), ZB-V's 2p plus one. The
  default table (a tick a send) runs the same order: the same makespan
  with free sends."""
  m = k * p
  plan = pipeline_schedule("dualpipev", p, m, 2, send_ticks=0)
  sim = plan.simulate()
  assert plan.ticks == 2 * m + 5 * p - 2
  assert sim.makespan == 6 * m + 2 * (p - 1)
  assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
  assert sim.peak_activations == (2 * p + 1,) * p
  zbv = pipeline_schedule("zb-v", p, m, 2, send_ticks=0).simulate()
  assert sim.makespan == zbv.makespan + p - 1
  assert max(sim.peak_activations) == max(zbv.peak_activations) + 1
  default = pipeline_schedule("dualpipev", p, m, 2)
  assert default.send_ticks == 1
  assert default.simulate(send=0).makespan == sim.makespan
  # the F&B cells: device r runs 2(m-2p+r+1) + (p-1-r) of them (device
  # p-1 one fewer: its first steady step runs F and B apart)
  pairs = [sum(isinstance(c, Pair) for _, c in o) for o in plan.device_orders()]
  assert pairs == [2 * (m - 2 * p + r + 1) + (p - 1 - r) - (r == p - 1)
                   for r in range(p)]
  assert all(isinstance(c.forward, tuple) and c.forward.kind == F
             and c.backward.kind == B and c.forward.chunk != c.backward.chunk
             for o in plan.device_orders() for _, c in o if isinstance(c, Pair))


@pytest.mark.parametrize("p,k", list(itertools.product((2, 4, 8), (2, 3))))
def test_dualpipev_idle_is_the_dualpipe_readmes(p, k):
  """With an F&B cell that overlaps (simulate's forward_backward below
  F + B), the most idle device idles (PP/2-1)(F&B + B - 3W), PP = 2p
  stages, the DualPipe README's bubble, wherever a backward's input half
  costs a forward (I = F); where it does not, this table's differs (p=8,
  F=1, I=1.5, W=0.5, F&B=2.5: 20 against 21)."""
  m = k * p
  plan = pipeline_schedule("dualpipev", p, m, 2, send_ticks=0)
  for f, i, w, fb in ((1, 1, 1, 3), (1, 1, 1, 2.5), (1, 1, 1, 2), (1, 1, 0.5, 2)):
    sim = plan.simulate(f, i, w, forward_backward=fb)
    cost = {F: f, I: i, W: w, B: i + w}
    busy = [sum(fb if isinstance(c, Pair) else cost[c.kind] for _, c in o)
            for o in plan.device_orders()]
    assert sim.makespan - min(busy) == pytest.approx((p - 1) * (fb + i + w - 3 * w))
    assert sim.bubble_fraction == pytest.approx(1 - sum(busy) / (p * sim.makespan))
  sim = plan.simulate(1, 1.5, 0.5, forward_backward=2.5)
  busy = [sum(2.5 if isinstance(c, Pair) else {F: 1, I: 1.5, W: 0.5, B: 2}[c.kind]
              for _, c in o) for o in plan.device_orders()]
  if p == 8:
    assert (sim.makespan - min(busy), 7 * (2.5 + 2 - 1.5)) == (20, 21)


def test_dualpipev_print():
  """An F&B cell prints as its two parts joined by '+'."""
  plan = pipeline_schedule("dualpipev", 2, 4, 2, send_ticks=0)
  assert plan.placement == "v"
  assert str(plan).splitlines()[7:11] == [
      "   6  F1.1     B0.1",
      "   7  F3+B1.1  F2.1+B0",
      "   8  F2.1+B0  F3+B1.1",
      "   9  B2.1     F3.1+B1",
  ]


def test_simulate_other_costs():
  # GPipe's and 1F1B's bubble does not depend on the F/B ratio.
  for schedule in ("gpipe", "1f1b"):
    sim = pipeline_schedule(schedule, 4, 8, send_ticks=0).simulate(1.0, 2.0, 0.5)
    assert sim.bubble_fraction == pytest.approx(3 / 11)
    assert sim.makespan == pytest.approx(11 * 3.5)
  # zb-h1 with a send as long as a forward: slower than without.
  plan = pipeline_schedule("zb-h1", 4, 8, send_ticks=0)
  assert plan.simulate(send=1.0).makespan > plan.simulate().makespan


def test_print_is_a_table():
  text = str(pipeline_schedule("1f1b", 2, 3, send_ticks=0))
  assert text.splitlines() == [
      "tick  stage 0  stage 1",
      "   0  F0       .",
      "   1  F1       F0",
      "   2  .        B0",
      "   3  B0       F1",
      "   4  F2       B1",
      "   5  B1       F2",
      "   6  .        B2",
      "   7  B2       .",
  ]
  assert "I0" in str(pipeline_schedule("zb-h1", 2, 2))
  assert "F0.1" in str(pipeline_schedule("interleaved", 2, 2, 2))
  assert "I0.1" in str(pipeline_schedule("zb-v", 2, 2, 2))


@pytest.mark.parametrize("args,match", [
    (("pipedream", 2, 2), "schedule='pipedream'"),
    (("1f1b", 1, 2), "stages=1"),
    (("1f1b", 4, 2), "microbatches >= stages"),
    (("interleaved", 2, 3, 2), "multiple of stages"),
    (("interleaved", 2, 4, 1), "virtual_stages >= 2"),
    (("1f1b", 2, 4, 2), "use schedule='interleaved'"),
    (("zb-v", 2, 4), "pass virtual_stages=2"),
    (("zb-v", 2, 4, 3), "virtual_stages=3"),
    (("zb-v", 4, 2, 2), "microbatches >= stages"),
    (("dualpipev", 2, 4), "pass virtual_stages=2"),
    (("dualpipev", 4, 7, 2), "microbatches >= 2 \\* stages"),
    (("gpipe", 2, 0), "microbatches=0"),
])
def test_unsupported_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    pipeline_schedule(*args)
