"""The link model and the dependency-aware bound, on hand-written HLO and on
every fixture.

Sizes: a [4096,4096] f32 dot run as one bf16 pass is about 139 us on the
H100 profile and an all-reduce of the same array about 290 us, so a transfer
beside two dots is hideable and one beside none is not.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from jax_overlap import OverlapReport

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
PROFILES = ["h100", "a100", "tpu-v5e", "tpu-v5p"]
M = "f32[4096,4096]{1,0}"
RING_UP = "{{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}"
RING_DOWN = "{{1,0},{2,1},{3,2},{4,3},{5,4},{6,5},{7,6},{0,7}}"
HEAD = """HloModule m, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""


def dot(name, a, b):
  # One bf16 pass (the bf16 rate; an f32 dot at the default precision is
  # TF32 on the H100 profile, half that).
  return (f"  %{name} = {M} dot(%{a}, %{b}), lhs_contracting_dims={{1}}, "
          "rhs_contracting_dims={0}, algorithm=dot_bf16_bf16_f32")


def all_reduce(name, operand):
  return (f"  %{name} = {M} all-reduce-start(%{operand}), "
          "replica_groups=[1,8]<=[8], to_apply=%add\n"
          f"  %{name}.done = {M} all-reduce-done(%{name})")


def permute(name, operand, pairs, done=True):
  text = (f"  %{name} = ({M}, {M}) collective-permute-start(%{operand}), "
          f"source_target_pairs={pairs}")
  if done:
    text += f"\n  %{name}.done = {M} collective-permute-done(%{name})"
  return text


def entry(*lines, params=3, root="ROOT %out = () tuple()"):
  ps = "\n".join(f"  %p{k} = {M} parameter({k})" for k in range(params))
  args = ", ".join(f"p{k}: f32[4096,4096]" for k in range(params))
  body = "\n".join(lines)
  return f"ENTRY %main ({args}) -> () {{\n{ps}\n{body}\n  {root}\n}}\n"


def report(text, hardware="h100") -> OverlapReport:
  return OverlapReport.from_hlo(HEAD + text, hardware=hardware)


def check_invariants(r: OverlapReport):
  t = r.totals
  assert t["bound_exposed_s"] <= t["exposed_s"] * (1 + 1e-9) + 1e-15, t
  for c in r.collectives:
    if c.exposed_s > c.comm_s * (1 + 1e-9) + 1e-15:
      assert any(f.startswith("queued behind") for f in c.flags), c
      assert c.queued_behind, c


# --- the bound --------------------------------------------------------------


def test_dependent_chain_saves_nothing():
  # collective -> compute -> collective -> compute, each feeding the next
  # (a distributed FFT): nothing can overlap, whatever the order.
  r = report(entry(all_reduce("a0", "p0"), dot("f0", "a0.done", "p1"),
                   all_reduce("a1", "f0"), dot("f1", "a1.done", "p1"),
                   root=f"ROOT %out = {M} copy(%f1)"))
  t = r.totals
  assert t["exposed_s"] == pytest.approx(t["comm_s"])
  assert t["bound_exposed_s"] == pytest.approx(t["comm_s"])
  # The old figure (all of it on one link, dependencies ignored) said a
  # perfect schedule hides everything but comm - compute.
  assert t["serial_link_bound_s"] == pytest.approx(
      max(0.0, t["comm_s"] - r.compute_s))
  assert t["serial_link_bound_s"] < 0.5 * t["bound_exposed_s"]
  check_invariants(r)
  assert "what the data dependencies force" in str(r)


def test_independent_chain_is_all_hideable():
  # The same transfer and compute, but the dots do not touch what is
  # reduced: scheduled after the done they hide nothing, yet could hide all.
  r = report(entry(all_reduce("a0", "p0"), dot("f0", "p2", "p1"),
                   dot("f1", "f0", "p1"),
                   root=f"ROOT %out = ({M}, {M}) tuple(%a0.done, %f1)"))
  t = r.totals
  assert r.compute_s > t["comm_s"]
  assert t["exposed_s"] == pytest.approx(t["comm_s"])
  assert t["bound_exposed_s"] == 0
  check_invariants(r)


def test_half_dependent_hides_only_the_independent_compute():
  # One dot feeds the collective, one is independent of it.
  r = report(entry(dot("f0", "p0", "p1"), all_reduce("a0", "f0"),
                   dot("f1", "p2", "p1"),
                   root=f"ROOT %out = ({M}, {M}) tuple(%a0.done, %f1)"))
  comm, = [c.comm_s for c in r.collectives]
  one_dot = r.compute_s / 2
  assert r.totals["bound_exposed_s"] == pytest.approx(comm - one_dot)
  check_invariants(r)


def _loop(body_lines, trip=6):
  carry = f"(s32[], {M}, {M})"
  body = "\n".join(body_lines)
  return f"""
%body (b: {carry}) -> {carry} {{
  %b = {carry} parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = {M} get-tuple-element(%b), index=1
  %w = {M} get-tuple-element(%b), index=2
{body}
  %one = s32[] constant(1)
  %i1 = s32[] add(%i, %one)
  ROOT %next = {carry} tuple(%i1, %y, %w)
}}

%cond (c: {carry}) -> pred[] {{
  %c = {carry} parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant({trip})
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}}

""" + entry(
      "  %zero = s32[] constant(0)",
      f"  %init = {carry} tuple(%zero, %p0, %p1)",
      f"  %loop = {carry} while(%init), condition=%cond, body=%body, "
      f'backend_config={{"known_trip_count":{{"n":"{trip}"}}}}',
      root=f"ROOT %out = {carry} copy(%loop)")


def test_loop_carried_chain_saves_nothing():
  # Each iteration reduces x and multiplies: iteration i+1 needs all of i.
  r = report(_loop([all_reduce("a", "x"), dot("d", "a.done", "w"),
                    dot("y", "d", "w")]))
  (c,) = r.collectives
  assert c.runs == 6
  assert r.totals["bound_exposed_s"] == pytest.approx(c.comm_s)
  assert r.totals["exposed_s"] == pytest.approx(c.comm_s)
  check_invariants(r)


def test_loop_hides_a_transfer_behind_the_neighbouring_iteration():
  # The transfer reads only w, which the loop carries unchanged; this
  # iteration's dots need it, but the previous iteration's do not: a
  # pipelined schedule (start it one iteration ahead) hides all of it.
  r = report(_loop([all_reduce("a", "w"), dot("d", "x", "a.done"),
                    dot("y", "d", "w")]))
  (c,) = r.collectives
  assert r.compute_s > c.comm_s
  assert c.exposed_s == pytest.approx(c.comm_s)
  assert r.totals["bound_exposed_s"] == 0
  check_invariants(r)


# --- links ------------------------------------------------------------------


def test_bidirectional_ring_runs_both_directions_at_once():
  r = report(entry(permute("up", "p0", RING_UP, done=False),
                   permute("down", "p1", RING_DOWN, done=False),
                   dot("f", "p2", "p2"),
                   f"  %up.done = {M} collective-permute-done(%up)",
                   f"  %down.done = {M} collective-permute-done(%down)",
                   root=f"ROOT %out = ({M}, {M}, {M}) tuple(%up.done, "
                   "%down.done, %f)"))
  up, down = r.collectives
  assert (up.link, down.link) == ("collective-permute +1",
                                  "collective-permute -1")
  assert up.queued_behind == down.queued_behind == []
  assert down.exposed_s <= down.comm_s
  check_invariants(r)


def test_one_direction_queues_and_says_behind_what():
  r = report(entry(permute("first", "p0", RING_UP, done=False),
                   permute("second", "p1", RING_UP, done=False),
                   f"  %second.done = {M} collective-permute-done(%second)",
                   f"  %first.done = {M} collective-permute-done(%first)",
                   root=f"ROOT %out = ({M}, {M}) tuple(%first.done, "
                   "%second.done)"))
  first, second = r.collectives
  assert second.queued_behind == ["first"]
  assert "queued behind first" in second.flags
  # Waited on first, it exposes both transfers: more than its own.
  assert second.exposed_s == pytest.approx(2 * second.comm_s)
  check_invariants(r)


@pytest.mark.parametrize("inner_pairs, queued", [(RING_UP, True),
                                                 (RING_DOWN, False)])
def test_inner_loop_permute_behind_an_outer_one(inner_pairs, queued):
  carry = f"(s32[], {M}, {M})"
  text = _loop([permute("inner", "x", inner_pairs), dot("y", "inner.done",
                                                        "w")], trip=3)
  # An outer permute started before the loop, done after it.
  text = text.replace(
      "  %zero = s32[] constant(0)",
      permute("outer", "p2", RING_UP, done=False) + "\n  %zero = s32[] "
      "constant(0)").replace(
      f"ROOT %out = {carry} copy(%loop)",
      f"%outer.done = {M} collective-permute-done(%outer)\n"
      f"  ROOT %out = ({carry}, {M}) tuple(%loop, %outer.done)")
  r = report(text)
  outer = next(c for c in r.collectives if c.start == "outer")
  inner = next(c for c in r.collectives if c.start == "inner")
  assert outer.overlapped == ["loop"]
  assert (inner.queued_behind == ["outer"]) is queued
  assert any(f == "queued behind outer" for f in inner.flags) is queued
  check_invariants(r)


FIXTURE_FILES = sorted(
    p for p in FIXTURES.rglob("*.txt")
    if not p.name.startswith(("malformed", "not_", "truncated")) and "versions" not in p.name)


# On older jax: the fixtures that jax's compilers made (the reader and the
# model are pure Python; CI's budget).
@pytest.mark.newest_jax(older_jax=[
    f"test_every_fixture_keeps_the_invariants[*jax{jax.__version__}*]"])
@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_every_fixture_keeps_the_invariants(path):
  text = path.read_text()
  for hardware in PROFILES:
    r = OverlapReport.from_hlo(text, hardware=hardware)
    check_invariants(r)
    assert r.totals["bound_exposed_s"] >= 0
