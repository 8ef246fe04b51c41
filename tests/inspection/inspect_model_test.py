"""The cost model, hardware profiles and the modelled timeline, by hand."""

from __future__ import annotations

import json
import pathlib

import pytest

from jax_overlap import HardwareProfile, HardwareProfileError, OverlapReport
from jax_overlap._src.inspection.model.cost_model import CostModel, shape_costs
from jax_overlap._src.inspection.model.hardware import resolve_hardware
from jax_overlap._src.inspection.reading.hlo_text import load_hlo, parse_hlo_text

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"

# Round numbers: 1e12 flop/s, 1e12 B/s of HBM, 1e9 B/s of link, no latency.
ROUND = HardwareProfile.from_dict({
    "name": "round", "peak_tflops": 1, "hbm_gbytes_per_s": 1000,
    "interconnect_gbytes_per_s": 1, "collective_latency_us": 0})


# --- hardware profiles --------------------------------------------------------

def test_builtin_profiles_carry_the_public_figures():
  assert HardwareProfile.builtin_names() == ["tpu-v5e", "tpu-v5p", "h100",
                                             "a100"]
  figures = {n: (p.peak_tflops, p.hbm_gbytes_per_s)
             for n in HardwareProfile.builtin_names()
             for p in [HardwareProfile.named(n)]}
  assert figures == {"tpu-v5e": (197, 819), "tpu-v5p": (459, 2765),
                     "h100": (989, 3350), "a100": (312, 2039)}
  # Half the vendor's both-directions interconnect figure.
  assert HardwareProfile.named("h100").interconnect_gbytes_per_s == 450
  assert HardwareProfile.named("tpu-v5e").interconnect_gbytes_per_s == 100


@pytest.mark.parametrize("name", ["H100", "h100", "TPU v5e", "tpu_v5e",
                                  "NVIDIA A100 SXM 80GB"])
def test_profile_names_match_loosely(name):
  assert HardwareProfile.named(name).name in HardwareProfile.builtin_names()


def test_unknown_profile_names_the_choices():
  with pytest.raises(HardwareProfileError,
                     match=r"unknown hardware 'b200'; built-in profiles are "
                           r"tpu-v5e, tpu-v5p, h100, a100"):
    HardwareProfile.named("b200")


def test_default_profile_is_h100():
  assert resolve_hardware(None).name == "h100"


@pytest.mark.parametrize("suffix, text", [
    (".toml", 'name = "mine"\npeak_tflops = 100\nhbm_gbytes_per_s = 1000\n'
              'interconnect_gbytes_per_s = 50\ncollective_latency_us = 2.5\n'),
    (".json", json.dumps({"name": "mine", "peak_tflops": 100,
                          "hbm_gbytes_per_s": 1000,
                          "interconnect_gbytes_per_s": 50,
                          "collective_latency_us": 2.5})),
])
def test_user_profile_files(tmp_path, suffix, text):
  path = tmp_path / f"chip{suffix}"
  path.write_text(text)
  for hardware in (path, str(path)):
    profile = resolve_hardware(hardware)
    assert (profile.name, profile.peak_tflops, profile.collective_latency_us) \
        == ("mine", 100.0, 2.5)
  r = OverlapReport.from_hlo(FIXTURES / "gpu_prefetch.txt", hardware=path)
  assert r.hardware.name == "mine"


@pytest.mark.parametrize("text, message", [
    ('name = "x"\npeak_tflops = 1\nhbm_gbytes_per_s = 1\n'
     'interconnect_gbytes_per_s = 1\n',
     "missing 'collective_latency_us'"),
    ('name = "x"\npeak_tflops = "fast"\nhbm_gbytes_per_s = 1\n'
     'interconnect_gbytes_per_s = 1\ncollective_latency_us = 1\n',
     "peak_tflops must be a number (dense bf16 TFLOP/s of one chip), got "
     "'fast'"),
    ('name = "x"\npeak_tflops = 0\nhbm_gbytes_per_s = 1\n'
     'interconnect_gbytes_per_s = 1\ncollective_latency_us = 1\n',
     "peak_tflops must be > 0"),
    ('name = "x"\npeak_tflops = 1\nhbm_gbytes_per_s = 1\n'
     'interconnect_gbytes_per_s = 1\ncollective_latency_us = -1\n',
     "collective_latency_us must be >= 0"),
    ('name = "x"\npeak_tflop = 1\n', "unknown key 'peak_tflop'"),
    ('name = "x"\npeak_tflops = [1\n', "is not valid TOML"),
])
def test_bad_profile_files_say_what_is_wrong(tmp_path, text, message):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(HardwareProfileError) as info:
    HardwareProfile.from_file(path)
  assert message in str(info.value)
  assert str(path) in str(info.value)


def test_missing_profile_file():
  with pytest.raises(HardwareProfileError, match="cannot read hardware "
                                                 "profile"):
    resolve_hardware("/nonexistent/chip.toml")


# --- formulas -----------------------------------------------------------------

@pytest.mark.parametrize("kind, factor", [
    ("all-gather", 7 / 8), ("all-to-all", 7 / 8), ("reduce-scatter", 7),
    ("all-reduce", 2 * 7 / 8), ("collective-permute", 1), ("send", 1),
    ("recv", 1)])
def test_ring_factors(kind, factor):
  model = CostModel(ROUND, None)
  assert model.collective_seconds(kind, 8e9, 8) == pytest.approx(8 * factor)


def test_latency_once_per_collective_and_nothing_for_one_device():
  profile = HardwareProfile.from_dict({
      "name": "l", "peak_tflops": 1, "hbm_gbytes_per_s": 1,
      "interconnect_gbytes_per_s": 1, "collective_latency_us": 5})
  model = CostModel(profile, None)
  assert model.collective_seconds("all-gather", 0, 8) == pytest.approx(5e-6)
  assert model.collective_seconds("all-gather", 1e9, 1) == 0
  # An unknown group size is modelled as 2 devices.
  assert model.collective_seconds("all-gather", 2e9, None) == \
      pytest.approx(5e-6 + 1.0)


def test_roofline():
  model = CostModel(ROUND, None)
  assert model.roofline(2e12, 1) == pytest.approx(2.0)        # compute bound
  assert model.roofline(1, 3e12) == pytest.approx(3.0)        # memory bound


def test_flops_from_shapes():
  module = load_hlo(FIXTURES / "gpu_prefetch.txt")
  entry = module.entry
  gemm = entry.by_name["cublas-gemm.1"]        # __cublas$lt$matmul
  flops, nbytes = shape_costs(gemm, entry, module)
  assert flops == 2 * 4096 * 8192 * 8192
  assert nbytes == (4096 * 8192 + 8192 * 8192) * 2 + 4096 * 8192 * 4
  tanh = entry.by_name["tanh_fusion"]          # no dot inside
  assert shape_costs(tanh, entry, module) == (0, 4096 * 8192 * (4 + 2))
  tpu = load_hlo(FIXTURES / "tpu_loop.txt")
  body = tpu.computations["while_body"]
  conv = body.by_name["conv_fusion"]           # convolution bf_io->bf
  assert shape_costs(conv, body, tpu)[0] == 2 * 256 * 1024 * 1024
  wrapped = load_hlo(FIXTURES / "gpu_async_wrapped.txt")
  dot = wrapped.entry.by_name["dot_fusion"]    # a dot inside a fusion
  assert shape_costs(dot, wrapped.entry, wrapped)[0] == 2 * 1024 * 512 * 512


def test_flops_a_pallas_kernel_states():
  # A Pallas TPU kernel's custom call carries pallas_call's cost_estimate
  # in its backend config (the v5e compiler's text of ring_attention's
  # flash kernel, shortened): its flops are those; another custom call
  # (no estimate) has none from shapes.
  config = json.dumps({"custom_call_config": {
      "body": "...", "cost_estimate": {"flops": "137438953472",
                                        "transcendentals": "268435456",
                                        "bytes_accessed": "50331648"}}})
  module = parse_hlo_text(f"""HloModule m, is_scheduled=true

ENTRY %main {{
  %q = bf16[1,8192,1024]{{2,1,0}} parameter(0)
  %k = bf16[1,8192,1024]{{2,1,0}} parameter(1)
  %kernel = (f32[1,8192,1024]{{2,1,0}}, f32[1,8,1,8192]{{3,2,1,0}}) custom-call(%q, %k), custom_call_target="tpu_custom_call", backend_config={json.dumps(config)}
  ROOT %other = bf16[1,8192,1024]{{2,1,0}} custom-call(%q), custom_call_target="Sharding"
}}
""")
  entry = module.entry
  flops, nbytes = shape_costs(entry.by_name["kernel"], entry, module)
  assert flops == 137438953472
  assert nbytes == 2 * 8192 * 1024 * 2 + 8192 * 1024 * 4
  assert shape_costs(entry.by_name["other"], entry, module)[0] == 0


# --- the modelled timeline ------------------------------------------------------

def _one_window(dots: int, trip: int | None = None) -> str:
  """An all-gather of 8000 bytes over 8 devices around `dots` matmuls of
  2e6 flops each, in a loop of `trip` iterations when given."""
  body = "\n".join(
      f"  %d{k} = f32[100,100]{{1,0}} dot(%x, %x), lhs_contracting_dims={{1}},"
      " rhs_contracting_dims={0}" for k in range(dots))
  comp = f"""
  %x = f32[100,100]{{1,0}} parameter(0)
  %s = f32[250]{{0}} parameter(1)
  %ag = (f32[250]{{0}}, f32[2000]{{0}}) all-gather-start(%s), replica_groups=[1,8]<=[8], dimensions={{0}}
{body}
  ROOT %agd = f32[2000]{{0}} all-gather-done(%ag)"""
  if trip is None:
    return f"HloModule m, is_scheduled=true\nENTRY %e {{{comp}\n}}\n"
  return f"""HloModule m, is_scheduled=true
%body {{
  %t = (f32[100,100], f32[250]) parameter(0)
  %x = f32[100,100]{{1,0}} get-tuple-element(%t), index=0
  %s = f32[250]{{0}} get-tuple-element(%t), index=1
  %ag = (f32[250]{{0}}, f32[2000]{{0}}) all-gather-start(%s), replica_groups=[1,8]<=[8], dimensions={{0}}
{body}
  %agd = f32[2000]{{0}} all-gather-done(%ag)
  ROOT %r = (f32[100,100], f32[250]) tuple(%x, %s)
}}
%cond {{
  %t2 = (f32[100,100], f32[250]) parameter(0)
  ROOT %c = pred[] constant(true)
}}
ENTRY %e {{
  %t0 = (f32[100,100], f32[250]) parameter(0)
  ROOT %w = (f32[100,100], f32[250]) while(%t0), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trip}"}}}}
}}
"""


@pytest.mark.parametrize("dots, exposed", [(0, 7e-6), (1, 5e-6), (3, 1e-6),
                                           (4, 0.0)])
def test_exposed_is_transfer_minus_window(dots, exposed):
  r = OverlapReport.from_hlo(_one_window(dots), hardware=ROUND)
  (c,) = r.collectives
  assert c.comm_s == pytest.approx(7e-6)       # 7/8 * 8000 B / 1e9 B/s
  assert c.exposed_s == pytest.approx(exposed, abs=1e-15)
  assert len(c.overlapped) == dots
  assert r.compute_s == pytest.approx(dots * 2e-6, rel=1e-3)
  # One computation: the bound is max(0, comm - compute).
  assert r.totals["bound_exposed_s"] == pytest.approx(
      max(0.0, 7e-6 - r.compute_s), abs=1e-15)


@pytest.mark.parametrize("trip", [1, 2, 3, 4, 5, 50, 1000])
def test_loops_scale_with_their_trip_count(trip):
  r = OverlapReport.from_hlo(_one_window(1, trip), hardware=ROUND)
  (c,) = r.collectives
  assert (c.runs, c.trip_count, c.loop) == (trip, trip, "w")
  assert c.comm_s == pytest.approx(trip * 7e-6)
  assert c.exposed_s == pytest.approx(trip * 5e-6)
  assert r.totals["bound_exposed_s"] == pytest.approx(
      trip * (7e-6 - 2e-6), rel=1e-3)


def test_unknown_trip_count_is_flagged():
  text = _one_window(1, 3).replace(
      ', backend_config={"known_trip_count":{"n":"3"}}', "")
  (c,) = OverlapReport.from_hlo(text, hardware=ROUND).collectives
  assert (c.runs, c.trip_count) == (1, None)
  assert "trip count unknown (modelled as 1)" in c.flags


def test_collectives_share_one_link():
  text = """HloModule m, is_scheduled=true
ENTRY %e {
  %s = f32[250]{0} parameter(0)
  %a = (f32[250]{0}, f32[2000]{0}) all-gather-start(%s), replica_groups=[1,8]<=[8], dimensions={0}
  %b = (f32[250]{0}, f32[2000]{0}) all-gather-start(%s), replica_groups=[1,8]<=[8], dimensions={0}
  %ad = f32[2000]{0} all-gather-done(%a)
  ROOT %bd = f32[2000]{0} all-gather-done(%b)
}
"""
  a, b = OverlapReport.from_hlo(text, hardware=ROUND).collectives
  assert a.exposed_s == pytest.approx(7e-6)
  assert b.exposed_s == pytest.approx(7e-6)   # queued behind a


def test_in_place_update_moves_only_its_slice():
  # A scan stacking residuals updates its buffer in place once a step: costing
  # the whole buffer made modelled compute grow with the square of the trip count.
  module = parse_hlo_text('''HloModule m, is_scheduled=true
%fused (p0: f32[24,256,256], p1: f32[1,256,256], p2: s32[]) -> f32[24,256,256] {
  %p0 = f32[24,256,256]{2,1,0} parameter(0)
  %p1 = f32[1,256,256]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[24,256,256]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}
ENTRY %main (a: f32[24,256,256], b: f32[1,256,256], i: s32[]) -> f32[24,256,256] {
  %a = f32[24,256,256]{2,1,0} parameter(0)
  %b = f32[1,256,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %d = f32[24,256,256]{2,1,0} dynamic-update-slice(%a, %b, %i, %z, %z)
  ROOT %f = f32[24,256,256]{2,1,0} fusion(%d, %b, %i), kind=kLoop, calls=%fused
}''')
  entry = module.entry
  slice_bytes = 256 * 256 * 4
  for name in ("d", "f"):
    _, nbytes = shape_costs(entry.by_name[name], entry, module)
    # the update read and the slice written (and the scalar indices)
    assert 2 * slice_bytes <= nbytes < 2 * slice_bytes + 64, (name, nbytes)


def test_sliced_operand_reads_only_its_slices():
  # A ring takes one block of a gathered buffer a step (and a scan one layer
  # of its stacked weights): costing the whole buffer read charged the
  # collective matmul rings 8 times their blocks' bytes a step.
  module = parse_hlo_text('''HloModule m, is_scheduled=true
%fused (p0: f32[8,256,256], p1: s32[]) -> f32[1,256,256] {
  %p0 = f32[8,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,256}
  ROOT %n = f32[1,256,256]{2,1,0} negate(%s)
}
%fused_both (q0: f32[8,256,256], q1: s32[]) -> (f32[1,256,256], f32[8,256,256]) {
  %q0 = f32[8,256,256]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,256,256]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,256,256}
  %e = f32[8,256,256]{2,1,0} exponential(%q0)
  ROOT %t = (f32[1,256,256]{2,1,0}, f32[8,256,256]{2,1,0}) tuple(%s, %e)
}
ENTRY %main (a: f32[8,256,256], i: s32[]) -> f32[1,256,256] {
  %a = f32[8,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %d = f32[1,256,256]{2,1,0} dynamic-slice(%a, %i, %z, %z), dynamic_slice_sizes={1,256,256}
  %c = f32[2,256,256]{2,1,0} slice(%a), slice={[0:2], [0:256], [0:256]}
  %f = f32[1,256,256]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused
  %g = (f32[1,256,256]{2,1,0}, f32[8,256,256]{2,1,0}) fusion(%a, %i), kind=kLoop, calls=%fused_both
  ROOT %r = f32[1,256,256]{2,1,0} add(%d, %f)
}''')
  entry = module.entry
  block = 256 * 256 * 4
  for name, moved in (("d", 2 * block), ("c", 4 * block), ("f", 2 * block)):
    _, nbytes = shape_costs(entry.by_name[name], entry, module)
    # the slice read and written (and the scalar indices)
    assert moved <= nbytes < moved + 64, (name, nbytes)
  # A parameter also read whole (the exponential) is read whole.
  _, nbytes = shape_costs(entry.by_name["g"], entry, module)
  assert nbytes >= 8 * block + 9 * block, nbytes
