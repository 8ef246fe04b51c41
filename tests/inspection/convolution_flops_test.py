"""A convolution's flops, counted on real input elements only
(model/convolution.py): against XLA's own cost analysis, and against the
einsums the real TPU compiler wrote as convolutions (tests/fixtures/hlo/costs,
made by tests/aot/make_cost_fixtures.py)."""

from __future__ import annotations

import json
import pathlib
import random

import jax
import pytest

from jax_overlap._src.inspection.model import xla_cost
from jax_overlap._src.inspection.model.convolution import (
    WindowDim, convolution_flops, landing_pairs)
from jax_overlap._src.inspection.model.cost_model import matmul_flops
from jax_overlap._src.inspection.reading.hlo_text import load_hlo, parse_hlo_text
from jax_overlap._src.inspection.schedule.pairing import read_schedule

COSTS = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo" / "costs"

#: (lhs, rhs, result, attributes, flops worked out by hand)
CASES = {
    # XLA:TPU's batched matmul: batch 4x8 on the spatial dimensions, each
    # output position meeting one input element.
    "tpu_batched_matmul": (
        "f32[4,8,128,64]", "f32[4,128,8,64]", "f32[4,8,128,128]",
        "window={size=4x8 stride=3x7 lhs_dilate=4x8}, dim_labels=01bf_0o1i->01bf",
        2 * 4 * 8 * 128 * 128 * 64),
    # Its gradient's form: padded and reversed, one tap of eight lands.
    "tpu_padded_reversed": (
        "f32[4,128,1024,1]", "bf16[8,128,1024,1]", "bf16[4,128,8,128]",
        "window={size=1x8 pad=0_0x7_7 rhs_reversal=0x1}, "
        "dim_labels=0bf1_1oi0->0b1f",
        2 * 4 * 8 * 128 * 128 * 1024),
    "tpu_contraction_on_spatial": (
        "f32[8,64,8]", "f32[8,64,16]", "f32[8,16,1]",
        "window={size=8}, dim_labels=0fb_0io->bf0", 2 * 8 * 16 * 64 * 8),
    "same_padding": (
        "f32[2,32,32,16]", "f32[3,3,16,8]", "f32[2,32,32,8]",
        "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
        # per dimension 32*3 pairs less the two that fall on the padding
        2 * 2 * 8 * 16 * (32 * 3 - 2) ** 2),
    "strided": (
        "f32[2,32,32,16]", "f32[3,3,16,8]", "f32[2,16,16,8]",
        "window={size=3x3 stride=2x2 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
        2 * 2 * 8 * 16 * (16 * 3 - 1) ** 2),
    "atrous": (
        "f32[2,32,32,16]", "f32[3,3,16,8]", "f32[2,28,28,8]",
        "window={size=3x3 rhs_dilate=2x2}, dim_labels=b01f_01io->b01f",
        2 * 2 * 8 * 16 * (28 * 3) ** 2),
    "transposed": (
        "f32[2,16,16,16]", "f32[3,3,16,8]", "f32[2,33,33,8]",
        "window={size=3x3 pad=2_2x2_2 lhs_dilate=2x2}, dim_labels=b01f_01io->b01f",
        2 * 2 * 8 * 16 * 48 ** 2),  # each of 16 inputs meets 3 taps
    "depthwise": (
        "f32[2,32,32,16]", "f32[3,3,1,16]", "f32[2,32,32,16]",
        "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, "
        "feature_group_count=16",
        2 * 2 * 16 * 1 * (32 * 3 - 2) ** 2),
    "batch_grouped": (
        "f32[16,32,32,4]", "f32[3,3,4,32]", "f32[4,30,30,32]",
        "window={size=3x3}, dim_labels=b01f_01io->b01f, batch_group_count=4",
        2 * 4 * 32 * 4 * (30 * 3) ** 2),
    "no_window": ("f32[8,128]", "f32[128,64]", "f32[8,64]",
                  "dim_labels=bf_io->bf", 2 * 8 * 64 * 128),
}


def _module(lhs, rhs, out, attributes) -> str:
  return f"""HloModule m, is_scheduled=true
ENTRY %e (a: {lhs}, b: {rhs}) -> {out} {{
  %a = {lhs} parameter(0)
  %b = {rhs} parameter(1)
  ROOT %c = {out} convolution(%a, %b), {attributes}
}}"""


def _ours(text: str) -> float:
  m = parse_hlo_text(text)
  return convolution_flops(m.entry.by_name["c"], m.entry.by_name["a"].shape,
                           m.entry.by_name["b"].shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_convolution_flops_by_hand(case):
  *shapes, flops = CASES[case]
  assert _ours(_module(*shapes)) == flops


@pytest.mark.parametrize("case", sorted(CASES))
def test_convolution_flops_are_xlas(case):
  functions = xla_cost._xla_functions()
  if functions is None:
    pytest.skip(f"jax {jax.__version__}'s jaxlib has no hlo_module_cost_analysis")
  from_text, analyse = functions
  text = _module(*CASES[case][:4])
  client = jax.devices("cpu")[0].client
  assert _ours(text) == analyse(client, from_text(text))["flops"]


def test_landing_pairs_count_what_a_loop_counts():
  rng = random.Random(0)
  for _ in range(3000):
    w = WindowDim(size=rng.randint(1, 9), stride=rng.randint(1, 5),
                  pad_low=rng.randint(-3, 6), lhs_dilate=rng.randint(1, 5),
                  rhs_dilate=rng.randint(1, 4))
    n_in, n_out = rng.randint(1, 12), rng.randint(1, 12)
    top = (n_in - 1) * w.lhs_dilate
    loop = sum(1 for o in range(n_out) for k in range(w.size)
               if 0 <= (p := o * w.stride + k * w.rhs_dilate - w.pad_low) <= top
               and p % w.lhs_dilate == 0)
    assert landing_pairs(n_in, n_out, w) == loop, (n_in, n_out, w)


def test_unreadable_labels_cost_nothing():
  assert _ours(_module("f32[8,128]", "f32[128,64]", "f32[8,64]",
                       "dim_labels=bf_io0->bf")) == 0


def _einsum_fixtures():
  expected = json.loads((COSTS / "expected.json").read_text())["flops"]
  return sorted(expected.items())


@pytest.mark.parametrize("name, expected", _einsum_fixtures(),
                         ids=[n for n, _ in _einsum_fixtures()])
def test_real_tpu_einsums_cost_their_true_flops(name, expected):
  # The rule before counted the kernel's size times the output's: 32x (a
  # batch of 4x8 heads) too many here.
  module = load_hlo(COSTS / f"tpu_v5e-{name}.as_text.txt")
  schedule = read_schedule(module)
  by_class: dict[str, float] = {}
  for comp in module.computations.values():
    if comp.name in schedule.schedules:
      for instr in comp.instructions:
        for cls, f in matmul_flops(instr, comp, module).items():
          by_class[cls] = by_class.get(cls, 0.0) + f
  assert sum(by_class.values()) == pytest.approx(expected["flops"], rel=0.02)
  # f32 at the default precision is one bf16 pass: XLA:TPU converts the
  # operands to bf16 itself; HIGHEST keeps them f32.
  want = "f32-highest" if expected["precision"] == "highest" else "bf16"
  assert set(by_class) == {want}, by_class
