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


@pytest.mark.parametrize("name, canonical", [
    ("v5e", "tpu-v5e"), ("V5E", "tpu-v5e"), ("TPU v5 lite", "tpu-v5e"),
    ("v5p", "tpu-v5p"), ("H100 SXM", "h100"), ("a100", "a100")])
def test_short_names_are_the_profile_they_name(name, canonical):
  # The report names the profile by its own name, not the alias.
  assert HardwareProfile.named(name).name == canonical
  r = OverlapReport.from_hlo(FIXTURES / "gpu_prefetch.txt", hardware=name)
  assert r.hardware.name == canonical
  assert f"times modelled on {canonical}" in str(r)


def test_unknown_profile_names_the_choices():
  with pytest.raises(HardwareProfileError,
                     match=r"unknown hardware 'b200'; built-in profiles are "
                           r"tpu-v5e, tpu-v5p, h100, a100 \(also by their "
                           r"short names: .*v5e.*\)"):
    HardwareProfile.named("b200")


def test_builtin_profiles_say_where_their_matmul_rates_come_from():
  v5e = HardwareProfile.named("tpu-v5e")
  # Measured on the chip (benchmarks/results/chip-2026-12-05): f32 at the
  # default precision runs about at the bf16 rate, HIGHEST about 6x slower.
  assert v5e.matmul_rate("bf16") == 189
  assert v5e.matmul_rate("f32") == 177
  assert v5e.matmul_rate("f32-highest") == pytest.approx(31.2)
  assert v5e.memory_gbytes_per_s == 660
  assert "measured on one TPU v5e" in v5e.achieved_source
  for name in HardwareProfile.builtin_names():
    profile = HardwareProfile.named(name)
    assert profile.achieved_source, name
    assert profile.matmul_rate("f8") == profile.matmul_tflops.get(
        "f8", profile.peak_tflops)
  h100 = HardwareProfile.named("h100")
  assert "not measured" in h100.achieved_source
  assert h100.memory_gbytes_per_s == h100.hbm_gbytes_per_s   # the spec's
  assert h100.matmul_rate("f32") < h100.matmul_rate("bf16")  # TF32


def test_profile_matmul_rates_from_a_file(tmp_path):
  path = tmp_path / "chip.toml"
  path.write_text('name = "c"\npeak_tflops = 100\nhbm_gbytes_per_s = 1000\n'
                  'interconnect_gbytes_per_s = 50\ncollective_latency_us = 1\n'
                  'achieved_hbm_gbytes_per_s = 800\n'
                  '[matmul_tflops]\nbf16 = 90\nf32-highest = 10\n')
  profile = HardwareProfile.from_file(path)
  assert profile.matmul_tflops == {"bf16": 90.0, "f32-highest": 10.0}
  assert profile.matmul_rate("int8") == 100           # not given: the peak
  assert profile.memory_gbytes_per_s == 800
  assert hash(profile) == hash(HardwareProfile.from_file(path))


@pytest.mark.parametrize("table, message", [
    ('matmul_tflops = 5\n', "matmul_tflops must be a table"),
    ('[matmul_tflops]\nf31 = 5\n', "matmul_tflops has unknown class 'f31'; "
                                    "the classes are bf16, f32, f32-high"),
    ('[matmul_tflops]\nbf16 = 0\n', "matmul_tflops.bf16 must be a number > 0"),
    ('[matmul_tflops]\nbf16 = "x"\n', "matmul_tflops.bf16 must be a number > 0"),
])
def test_bad_matmul_rates_say_what_is_wrong(tmp_path, table, message):
  path = tmp_path / "bad.toml"
  path.write_text('name = "c"\npeak_tflops = 100\nhbm_gbytes_per_s = 1000\n'
                  'interconnect_gbytes_per_s = 50\ncollective_latency_us = 1\n'
                  + table)
  with pytest.raises(HardwareProfileError) as info:
    HardwareProfile.from_file(path)
  assert message in str(info.value)


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
  # Its flops are class 'kernel', timed at the profile's kernel rate (the
  # v5e's measured one, below its bf16 matmuls'), not as a bf16 dot.
  from jax_overlap._src.inspection.model.cost_model import matmul_flops
  from jax_overlap._src.inspection.model.hardware import HardwareProfile
  assert matmul_flops(entry.by_name["kernel"], entry, module) == {
      "kernel": 137438953472}
  v5e = HardwareProfile.named("tpu-v5e")
  assert v5e.matmul_rate("kernel") < 0.8 * v5e.matmul_rate("bf16")
  assert HardwareProfile.named("h100").matmul_rate("kernel") == \
      HardwareProfile.named("h100").peak_tflops    # not measured there


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


# --- matmul classes, precision, data movement -------------------------------------

def _dot(lhs, rhs, extra=""):
  return parse_hlo_text(f'''HloModule m, is_scheduled=true
ENTRY %main (a: {lhs}[256,256], b: {rhs}[256,256]) -> f32[256,256] {{
  %a = {lhs}[256,256]{{1,0}} parameter(0)
  %b = {rhs}[256,256]{{1,0}} parameter(1)
  ROOT %d = f32[256,256]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{extra}
}}''')


@pytest.mark.parametrize("lhs, rhs, extra, cls", [
    ("bf16", "bf16", "", "bf16"),
    ("f16", "f16", "", "bf16"),
    ("f32", "f32", "", "f32"),
    ("f32", "bf16", "", "f32"),
    ("f32", "f32", ", operand_precision={high,high}", "f32-high"),
    ("f32", "f32", ", operand_precision={default,highest}", "f32-highest"),
    ("bf16", "bf16", ", operand_precision={highest,highest}", "bf16"),
    ("f32", "f32", ", algorithm=dot_bf16_bf16_f32_x6", "f32-highest"),
    ("f32", "f32", ", algorithm=dot_bf16_bf16_f32_x3", "f32-high"),
    ("f32", "f32", ", algorithm=dot_tf32_tf32_f32", "f32"),
    ("f8e4m3fn", "f8e5m2", "", "f8"),
    ("s8", "s8", "", "int8"),
    ("f64", "f64", "", "f64"),
])
def test_matmul_classes(lhs, rhs, extra, cls):
  from jax_overlap._src.inspection.model.matmul_class import matmul_class
  module = _dot(lhs, rhs, extra)
  d = module.entry.by_name["d"]
  assert matmul_class(d, [module.entry.by_name[o].shape
                          for o in d.operands]) == cls


def test_gemm_precision_comes_from_its_config():
  from jax_overlap._src.inspection.model.cost_model import matmul_flops
  module = load_hlo(FIXTURES / "gpu_prefetch.txt")
  gemm = module.entry.by_name["cublas-gemm.1"]
  assert matmul_flops(gemm, module.entry, module) == {
      "bf16": 2 * 4096 * 8192 * 8192}
  text = (FIXTURES / "gpu_prefetch.txt").read_text().replace(
      '"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"',
      '"operand_precision":["HIGHEST","HIGHEST"],"algorithm":"ALG_UNSET"')
  module = parse_hlo_text(text)
  gemm = module.entry.by_name["cublas-gemm.1"]
  # bf16 operands: HIGHEST changes nothing.
  assert list(matmul_flops(gemm, module.entry, module)) == ["bf16"]


def test_a_matmul_runs_at_its_class_rate():
  # 2 * 256^3 flops; 1 TFLOP/s for bf16, 0.1 for f32 at HIGHEST; 3 x 256 KiB
  # of f32 at 1 TB/s is 0.8 us, far below.
  profile = HardwareProfile.from_dict({
      "name": "r", "peak_tflops": 1, "hbm_gbytes_per_s": 1000,
      "interconnect_gbytes_per_s": 1, "collective_latency_us": 0,
      "matmul_tflops": {"f32-highest": 0.1}})
  flops = 2 * 256 ** 3
  for extra, rate in (("", 1.0), (", operand_precision={highest,highest}", 0.1)):
    module = _dot("f32", "f32", extra)
    model = CostModel(profile, module)
    seconds = model.compute_seconds(module.entry.by_name["d"], module.entry)
    assert seconds == pytest.approx(flops / (rate * 1e12))
  # A fusion holding both runs each at its own rate.
  module = parse_hlo_text('''HloModule m, is_scheduled=true
%fused (p0: f32[256,256], p1: bf16[256,256]) -> f32[256,256] {
  %p0 = f32[256,256]{1,0} parameter(0)
  %p1 = bf16[256,256]{1,0} parameter(1)
  %hi = f32[256,256]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %lo = f32[256,256]{1,0} dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %s = f32[256,256]{1,0} add(%hi, %lo)
}
ENTRY %main (a: f32[256,256], b: bf16[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0} parameter(0)
  %b = bf16[256,256]{1,0} parameter(1)
  ROOT %f = f32[256,256]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
}''')
  model = CostModel(profile, module)
  seconds = model.compute_seconds(module.entry.by_name["f"], module.entry)
  assert seconds == pytest.approx(flops / 0.1e12 + flops / 1e12)


def test_memory_bound_work_runs_at_the_achieved_bandwidth():
  profile = HardwareProfile.from_dict({
      "name": "r", "peak_tflops": 1, "hbm_gbytes_per_s": 1000,
      "achieved_hbm_gbytes_per_s": 500, "interconnect_gbytes_per_s": 1,
      "collective_latency_us": 0})
  assert CostModel(profile, None).roofline(0, 1e9) == pytest.approx(2e-3)


STANDALONE = '''HloModule m, is_scheduled=true, num_partitions=2
ENTRY %main (p: f32[1024,1024], i: s32[]) -> (f32[1024,1024], bf16[1024,1024], f32[2,1024,1024]) {
  %p = f32[1024,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ag = (f32[512,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}
  %t = f32[1024,1024]{0,1} transpose(%p), dimensions={1,0}
  %c = bf16[1024,1024]{1,0} convert(%p)
  %b = f32[2,1024,1024]{2,1,0} broadcast(%p), dimensions={1,2}
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %buf = f32[1024,1024]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %agd = f32[1024,1024]{1,0} all-gather-done(%ag)
  ROOT %r = (f32[1024,1024]{1,0}, bf16[1024,1024]{1,0}, f32[2,1024,1024]{2,1,0}) tuple(%t, %c, %b)
}'''


def test_data_movement_outside_fusions_is_work():
  # A transpose, a convert and a broadcast standing alone read and write
  # memory (the TPU demo step's took 1.9 ms of 15); the scalar add is the
  # loop's bookkeeping and the AllocateBuffer call moves nothing.
  report = OverlapReport.from_hlo(STANDALONE, hardware=ROUND)
  (c,) = report.collectives
  assert c.overlapped == ["t", "c", "b"]
  mib = 1024 * 1024
  moved = (4 + 4) * mib + (4 + 2) * mib + (4 + 8) * mib   # in and out of each
  assert report.compute_s == pytest.approx(moved / 1e12)


def test_gathers_and_views_of_slices_read_their_slices():
  module = parse_hlo_text('''HloModule m, is_scheduled=true
%fused (p0: f32[8,256,256], p1: s32[]) -> f32[256,256] {
  %p0 = f32[8,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %v = f32[8,65536]{1,0} bitcast(%p0)
  %s = f32[1,65536]{1,0} dynamic-slice(%v, %p1, %z), dynamic_slice_sizes={1,65536}
  ROOT %n = f32[256,256]{1,0} bitcast(%s)
}
%fused_update (q0: f32[8,256,256], q1: f32[1,256,256], q2: s32[]) -> f32[8,256,256] {
  %q0 = f32[8,256,256]{2,1,0} parameter(0)
  %q1 = f32[1,256,256]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[8,256,256]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
  ROOT %w = f32[8,256,256]{2,1,0} bitcast(%u)
}
ENTRY %main (a: f32[8,256,256], i: s32[], idx: s32[4,1]) -> f32[4,256,256] {
  %a = f32[8,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %idx = s32[4,1]{1,0} parameter(2)
  %f = f32[256,256]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused
  %fb = f32[1,256,256]{2,1,0} bitcast(%f)
  %g = f32[8,256,256]{2,1,0} fusion(%a, %fb, %i), kind=kLoop, calls=%fused_update
  ROOT %e = f32[4,256,256]{2,1,0} gather(%a, %idx), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,256,256}
}''')
  entry = module.entry
  block = 256 * 256 * 4
  for name, moved in (("f", 2 * block), ("g", 2 * block), ("e", 8 * block)):
    _, nbytes = shape_costs(entry.by_name[name], entry, module)
    assert moved <= nbytes < moved + 64, (name, nbytes / block)


def test_the_tpus_on_chip_memory_is_not_hbm_traffic():
  # XLA:TPU's memory-space assignment puts arrays in memory space 1 of a
  # tiled layout (on chip); an op reading one there moves none of it
  # through HBM (measured on v5e: a fusion reading 100 MB in S(1) and
  # 201 MB in HBM ran at 652 GB/s of the HBM bytes alone).
  module = parse_hlo_text('''HloModule m, is_scheduled=true
ENTRY %main (a: f32[1024,1024], b: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0:T(8,128)S(1)} parameter(0)
  %b = f32[1024,1024]{1,0:T(8,128)} parameter(1)
  ROOT %s = f32[1024,1024]{1,0:T(8,128)} add(%a, %b)
}''')
  _, nbytes = shape_costs(module.entry.by_name["s"], module.entry, module)
  assert nbytes == 2 * 4 * 1024 * 1024     # b read, s written; a on chip
  # S(1) means nothing without TPU tiles: all of it counts.
  module = parse_hlo_text('''HloModule m, is_scheduled=true
ENTRY %main (a: f32[1024,1024], b: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0:S(1)} parameter(0)
  %b = f32[1024,1024]{1,0} parameter(1)
  ROOT %s = f32[1024,1024]{1,0} add(%a, %b)
}''')
  _, nbytes = shape_costs(module.entry.by_name["s"], module.entry, module)
  assert nbytes == 3 * 4 * 1024 * 1024


def test_a_cross_program_prefetch_costs_nothing():
  # XLA:TPU prefetches an operand for the next run of the program
  # (cross_program_prefetch_index); measured on v5e, the 4096^2 bf16 matmul
  # whose operand it prefetched ran in its matmul time alone (0.719 ms).
  text = '''HloModule m, is_scheduled=true
ENTRY %main (a: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %cs = (bf16[4096,4096]{1,0:T(8,128)(2,1)S(1)}, bf16[4096,4096]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%a)XX
  ROOT %cd = bf16[4096,4096]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
}'''
  prefetch = OverlapReport.from_hlo(
      text.replace("XX", ", cross_program_prefetch_index=0"), hardware="v5e")
  plain = OverlapReport.from_hlo(text.replace("XX", ""), hardware="v5e")
  assert prefetch.copies[0].copy_s == 0 and prefetch.step_s == 0
  assert plain.copies[0].copy_s > 0 and plain.step_s > 0


def test_a_slice_in_a_nested_fusion_reads_its_slice():
  # XLA:TPU fuses the dynamic-slice of one layer of stacked weights as a
  # fusion of its own inside the matmul's: the stack is read a layer a step
  # (on v5e such a fusion ran in its slice's time, not the stack's).
  module = parse_hlo_text('''HloModule m, is_scheduled=true
%slice_one (q0: f32[8,256,256], q1: s32[]) -> f32[256,256] {
  %q0 = f32[8,256,256]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = f32[1,256,256]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,256,256}
  ROOT %b = f32[256,256]{1,0} bitcast(%s)
}
%outer (p0: f32[8,256,256], p1: s32[], p2: f32[256,256]) -> f32[256,256] {
  %p0 = f32[8,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[256,256]{1,0} parameter(2)
  %w = f32[256,256]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%slice_one
  ROOT %d = f32[256,256]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (a: f32[8,256,256], i: s32[], x: f32[256,256]) -> f32[256,256] {
  %a = f32[8,256,256]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[256,256]{1,0} parameter(2)
  ROOT %f = f32[256,256]{1,0} fusion(%a, %i, %x), kind=kOutput, calls=%outer
}''')
  block = 256 * 256 * 4
  _, nbytes = shape_costs(module.entry.by_name["f"], module.entry, module)
  assert 3 * block <= nbytes < 3 * block + 64, nbytes / block  # slice, x, out
