"""The reader on real CPU output of XLA, not hand-written text.

`fixtures/hlo/real/` holds, for each supported jax, the `--xla_dump_to`
file (`*.dump.txt`) and `compile().as_text()` (`*.as_text.txt`) of one
compile of the same ordered program (futures, a `lax.scan`, a matmul), made
by `fixtures/make_cpu_dumps.py`. Each is read by the inspector and checked
against a count made here from the text alone, with regular expressions.
"""

from __future__ import annotations

import math
import pathlib
import re

import pytest

from jax_overlap import OverlapReport
from jax_overlap._src.cli.main import main

REAL = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo" / "real"
DUMPS = sorted(REAL.glob("*.dump.txt"))
VERSIONS = [p.name[:-len(".dump.txt")] for p in DUMPS]

_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* "
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(")
_WHILE = re.compile(r"body=%([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"\}")


def count_from_text(text: str) -> list[tuple[str, str, float, int]]:
  """(kind, name, bytes, runs) of every collective, read with regexes:
  runs is the `known_trip_count` of the while whose body holds it."""
  trips = {body: int(n) for body, n in _WHILE.findall(text)}
  found, computation = [], None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      computation = m.group(1)
      continue
    m = _COLLECTIVE.match(line)
    if m:
      name, dtype, dims, kind = m.groups()
      nbytes = _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      found.append((kind, name, nbytes, trips.get(computation, 1)))
  return sorted(found)


def read(path: pathlib.Path) -> list[tuple[str, str, float, int]]:
  report = OverlapReport.from_hlo(path)
  return sorted((c.kind, c.start, c.bytes, c.runs) for c in report.collectives)


def test_there_is_a_dump_and_an_as_text_for_every_supported_jax():
  assert {v.split("-jaxlib")[0] for v in VERSIONS} >= {
      "cpu-jax0.10.2", "cpu-jax0.11.0", "cpu-jax0.12.0.1"}
  for v in VERSIONS:
    assert (REAL / f"{v}.as_text.txt").exists()


# The CPU fixtures, whose program is known; every fixture, GPU and TPU ones
# included, is counted by tests/inspection/inspect_real_forms_test.py.
@pytest.mark.parametrize("path", sorted(REAL.glob("cpu-*.txt")), ids=lambda p: p.name)
def test_collectives_match_an_independent_count(path):
  text = path.read_text()
  expected = count_from_text(text)
  # the program: a gathered weight per scan iteration, a psum, a ppermute
  assert sorted(k for k, *_ in expected) == [
      "all-gather", "all-reduce", "collective-permute"]
  assert read(path) == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_dump_and_as_text_of_one_compile_give_the_same_collectives(version):
  dump = OverlapReport.from_hlo(REAL / f"{version}.dump.txt")
  as_text = OverlapReport.from_hlo(REAL / f"{version}.as_text.txt")
  fields = ("kind", "start", "done", "computation", "bytes", "group_size",
            "runs", "made_blocking", "comm_s", "exposed_s", "flags")
  assert [{k: c.to_dict()[k] for k in fields} for c in dump.collectives] == \
      [{k: c.to_dict()[k] for k in fields} for c in as_text.collectives]
  assert dump.totals == pytest.approx(as_text.totals)


def test_newer_dumps_write_tuple_elements_as_hash_operands():
  """What the reader had to learn: `%param#1` where as_text() writes a
  get-tuple-element (jax 0.11 and 0.12 dumps; 0.10.2 has none)."""
  hash_operand = re.compile(r"%[\w.\-]+#\d+")
  for version in VERSIONS:
    dump = (REAL / f"{version}.dump.txt").read_text()
    as_text = (REAL / f"{version}.as_text.txt").read_text()
    assert not hash_operand.search(as_text)
    if "jax0.10." not in version:
      assert hash_operand.search(dump), version


@pytest.mark.parametrize("version", VERSIONS)
def test_cli_reads_a_real_dump(capsys, version):
  assert main(["inspect", str(REAL / f"{version}.dump.txt")]) == 0
  out = capsys.readouterr().out
  assert "all-gather" in out and "collective-permute" in out


def test_hash_operands_nest_and_a_missing_element_names_the_line():
  from jax_overlap import HloParseError  # noqa: PLC0415
  text = """HloModule m, is_scheduled=true, num_partitions=2
ENTRY %main (p: ((f32[4], f32[8]), s32[])) -> f32[16] {
  %p = ((f32[4]{0}, f32[8]{0}), s32[]) parameter(0)
  %ag = f32[16]{0} all-gather(%p#0#1), replica_groups={{0,1}}, dimensions={0}
  ROOT %n = f32[16]{0} negate(%ag)
}"""
  report = OverlapReport.from_hlo(text)
  assert [(c.kind, c.bytes) for c in report.collectives] == [("all-gather", 64)]
  with pytest.raises(HloParseError, match=r":4: operand %p#0#2: %p#0 has no element 2"):
    OverlapReport.from_hlo(text.replace("%p#0#1", "%p#0#2"))
