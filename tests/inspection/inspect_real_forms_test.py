"""The reader on every form real compilers write, checked by a count of our own.

Every file in `fixtures/hlo/real/` (CPU, GPU and TPU; `--xla_dump_to` dump
files and `compile().as_text()`, of every jax version there: made by
`fixtures/make_cpu_dumps.py` and `aot/make_real_fixtures.py`, versions in
`*versions.txt`) is read by the inspector, and its collectives (kind, bytes,
runs, the number of compute instructions in each window) and async copies
are compared with a count made here from the text alone, with regular
expressions and none of the library's parser. The forms:

* GPU dumps: `async-start(...), calls=%async_computation` / `async-done`,
  where `as_text()` writes `all-gather-start(`;
* TPU async collective fusion chains: a start fusion (its body's root a
  custom-call "AsyncCollectiveStart"), continuation fusions
  (`continuation_config`) fusing compute, and a done fusion: one collective,
  with the bytes of the collective in their bodies;
* `copy-start` and `slice-start` async copies (a TPU dump writes
  `async-start` of a slice);
* loops with no `known_trip_count` (TPU), counted from their condition, the
  start in the init tuple and the step in the body; nested loops multiply.

A fixture added under the same names (e.g. for another jax version) is read
by these tests with no change here.
"""

from __future__ import annotations

import math
import pathlib
import re

import jax
import pytest

from jax_overlap._src.inspection.report.overlap_report import OverlapReport

REAL = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo" / "real"
FIXTURES = sorted(p for p in REAL.glob("*.txt") if "versions" not in p.name
                  and p.read_text().lstrip().startswith("HloModule"))
# A dump and the as_text() of the same compile: stem -> (dump, as_text).
_DUMP_SUFFIXES = (".after_optimizations.txt", ".dump.txt")
PAIRS = {}
for _p in FIXTURES:
  for _suffix in _DUMP_SUFFIXES:
    if _p.name.endswith(_suffix):
      _stem = _p.name[:-len(_suffix)]
      if (REAL / f"{_stem}.as_text.txt").exists():
        PAIRS[_stem] = (_p, REAL / f"{_stem}.as_text.txt")

_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
          "f16": 2, "s16": 2, "u16": 2, "pred": 1, "s8": 1, "u8": 1,
          "f8e4m3fn": 1, "f8e5m2": 1}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute", "collective-broadcast", "ragged-all-to-all")
_COMPUTE = ("fusion", "custom-call", "dot", "convolution")
# Ops that are not work when they stand alone (names, bookkeeping, pairs).
_NOT_WORK = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast",
             "after-all", "add-dependency", "opt-barrier", "partition-id",
             "replica-id", "send", "recv", "while", "call", "conditional",
             "domain") + COLLECTIVES
_COMP_HEAD = re.compile(r"^(ENTRY )?%(\S+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+(?:#\d+)*)")


# --- an independent reading of the text -------------------------------------------

class Text:
  """Computations as lists of (name, opcode, shape text, operand names, line)."""

  def __init__(self, text: str):
    self.comps: dict[str, list[tuple]] = {}
    self.entry = None
    current = None
    for line in text.splitlines():
      head = _COMP_HEAD.match(line)
      if head and not line.startswith(" "):
        current = head.group(2)
        self.comps[current] = []
        if head.group(1):
          self.entry = current
        continue
      if line.startswith("}"):
        current = None
        continue
      m = _INSTR.match(line)
      if current is None or not m:
        continue
      rest = m.group(3)
      op = _OPCODE.search(rest)
      shape = rest[:op.start(1)].strip()
      args = _bracketed(rest, op.end(1))
      self.comps[current].append(dict(
          name=m.group(2), op=op.group(1), shape=shape,
          operands=_NAME.findall(args), line=line, root=bool(m.group(1))))
    self.by_name = {c: {i["name"]: i for i in ins} for c, ins in self.comps.items()}

  def callee(self, instr, key):
    m = re.search(rf"\b{key}=%([\w.\-]+)", instr["line"])
    return m.group(1) if m else None

  def schedules(self) -> dict[str, list[str]]:
    """Computations that run as a sequence -> the while loops around them
    (innermost last), as (caller, while name)."""
    out = {self.entry: []}
    todo = [self.entry]
    while todo:
      comp = todo.pop()
      for i in self.comps[comp]:
        targets = []
        if i["op"] == "while":
          targets = [(self.callee(i, "body"), out[comp] + [(comp, i["name"])]),
                     (self.callee(i, "condition"), out[comp])]
        elif i["op"] == "call":
          targets = [(self.callee(i, "to_apply"), out[comp])]
        elif i["op"] == "conditional":
          names = re.findall(r"%([\w.\-]+)", re.search(
              r"branch_computations=\{([^}]*)\}", i["line"]).group(1))
          targets = [(n, out[comp]) for n in names]
        for name, loops in targets:
          if name and name not in out:
            out[name] = loops
            todo.append(name)
    return out

  def trips(self, caller, while_name) -> int:
    """The trip count of a while: XLA's known_trip_count, else counted from
    the condition `compare(gte(param, i), constant(N))`, the init tuple's
    element i and the body's `add(gte(param, i), constant(K))`."""
    w = self.by_name[caller][while_name]
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', w["line"])
    if known:
      return int(known.group(1))
    cond, body = self.callee(w, "condition"), self.callee(w, "body")
    root = next(i for i in self.comps[cond] if i["root"])
    direction = re.search(r"direction=(\w+)", root["line"]).group(1)
    assert root["op"] == "compare" and direction == "LT", root["line"]
    index, bound = None, None
    for operand in root["operands"]:
      element = self._element(cond, operand)
      if element is not None:
        index = element
      else:
        bound = self._constant(cond, operand)
    init = self.by_name[caller][w["operands"][0]]
    assert init["op"] == "tuple", init["line"]
    start = self._constant(caller, init["operands"][index])
    body_root = next(i for i in self.comps[body] if i["root"])
    update = self.by_name[body][body_root["operands"][index]]
    assert update["op"] == "add", update["line"]
    step = [self._constant(body, o) for o in update["operands"]
            if self._element(body, o) is None][0]
    return max(0, math.ceil((bound - start) / step))

  def _element(self, comp, name):
    while True:
      if "#" in name:  # a dump's `%param#i`
        return int(name.rsplit("#", 1)[1])
      i = self.by_name[comp][name]
      if i["op"] in ("copy", "bitcast", "convert"):
        name = i["operands"][0]
        continue
      if i["op"] == "get-tuple-element":
        return int(re.search(r"index=(\d+)", i["line"]).group(1))
      return None

  def _constant(self, comp, name):
    i = self.by_name[comp][name]
    while i["op"] in ("copy", "bitcast", "convert"):
      i = self.by_name[comp][i["operands"][0]]
    assert i["op"] == "constant", i["line"]
    return int(re.search(r"constant\((-?\d+)\)", i["line"]).group(1))

  def holds(self, comp) -> tuple[list[dict], bool]:
    """(collectives, whether there is compute) in `comp` and what it fuses or
    wraps; chain markers are not compute."""
    found, compute = [], False
    for i in self.comps[comp]:
      if i["op"] in COLLECTIVES:
        found.append(i)
      elif i["op"] == "custom-call" and "AsyncCollective" in i["line"]:
        pass
      elif i["op"] in ("fusion", "call") or i["op"].endswith("-start"):
        callee = self.callee(i, "calls") or self.callee(i, "to_apply")
        if callee:
          f, c = self.holds(callee)
          found += f
          compute = compute or c or (i["op"] == "fusion" and not f)
      elif i["op"] in _COMPUTE:
        compute = True
    return found, compute

  def chain_role(self, i):
    if i["op"] != "fusion":
      return None
    body = self.callee(i, "calls")
    root = next(x for x in self.comps[body] if x["root"])
    if 'custom_call_target="AsyncCollectiveStart"' in root["line"]:
      return "start"
    if 'custom_call_target="AsyncCollectiveDone"' in root["line"]:
      return "done"
    if '"continuation_config"' in i["line"]:
      return "continuation"
    return None

  def is_compute(self, i) -> bool:
    if i["op"] in _COMPUTE and 'custom_call_target="AllocateBuffer"' in i["line"]:
      return False
    if i["op"] in _COMPUTE:
      if self.chain_role(i) in ("start", "done"):
        return False
      callee = self.callee(i, "calls")
      if i["op"] == "fusion" and callee:
        found, compute = self.holds(callee)
        return not found or compute
      return not (i["op"] == "custom-call" and "AsyncCollective" in i["line"])
    if i["op"] in ("while", "call", "conditional"):
      callees = re.findall(r"(?:body|condition|to_apply|branch_computations)="
                           r"\{?%([\w.\-]+)", i["line"])
      return any(self.holds(c)[1] for c in callees)
    # Data movement standing alone: an array (not a scalar, not a tuple).
    return (i["op"] not in _NOT_WORK
            and not re.search(r"-(start|done|update)$", i["op"])
            and not i["shape"].startswith("(")
            and re.match(r"[a-z0-9]+\[\d", i["shape"]) is not None)


def _bracketed(text, open_at):
  depth = 0
  for k in range(open_at, len(text)):
    depth += {"(": 1, ")": -1}.get(text[k], 0)
    if depth == 0:
      return text[open_at + 1:k]
  return text[open_at + 1:]


def _bytes(shape_text: str) -> int:
  """Logical bytes of a shape's arrays, scalar u32/s32 contexts aside."""
  total = 0
  for dtype, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", shape_text)):
    if dtype not in _BYTES or (not dims and dtype in ("u32", "s32") and
                               shape_text.startswith("(")):
      continue
    total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _tuple_elements(shape_text: str) -> list[str]:
  inner, depth, out, cur = shape_text.strip()[1:-1], 0, [], ""
  for ch in inner:
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur)
      cur = ""
    else:
      cur += ch
  return out + [cur]


def count_from_text(text: str):
  """{start name: (kind, bytes, runs, compute in its window or None when
  start and done are not in one computation)} and the async copies
  [(start, bytes, runs)], read from the text alone."""
  t = Text(text)
  collectives, copies = {}, []
  for comp, loops in t.schedules().items():
    runs = math.prod(t.trips(c, w) for c, w in loops)
    instrs = t.comps[comp]
    users = {}
    for k, i in enumerate(instrs):
      for o in i["operands"]:
        users.setdefault(o.split("#")[0], []).append(k)
    for k, i in enumerate(instrs):
      op, role = i["op"], t.chain_role(i)
      if op in COLLECTIVES:
        collectives[i["name"]] = (op, _bytes(i["shape"]), runs, None)
        continue
      if role == "start":
        inner = t.holds(t.callee(i, "calls"))[0][0]
        done = _chain_done(t, instrs, k, users)
        collectives[i["name"]] = (inner["op"], _bytes(inner["shape"]), runs,
                                  _window(t, instrs, k, done))
        continue
      if role is None and op == "fusion":
        assert not t.holds(t.callee(i, "calls"))[0], (
            "a fusion holding a collective outside a chain: count it here", i["line"])
      if not op.endswith("-start"):
        continue
      done = next((j for j in users.get(i["name"], [])
                   if instrs[j]["op"].endswith("-done")), None)
      callee = t.callee(i, "calls")
      wrapped = t.comps[callee] if callee else []
      inner = [x for x in wrapped if x["op"] not in ("parameter", "tuple",
                                                     "get-tuple-element")]
      if op in ("copy-start", "slice-start") or (
          op == "async-start" and [x["op"] for x in inner] in (["slice"],
                                                              ["dynamic-slice"])):
        nbytes = _bytes(instrs[done]["shape"]) if done is not None else None
        copies.append((i["name"], nbytes, runs))
        continue
      kind = op[:-len("-start")]
      if op in ("async-start", "fusion-start"):
        found, compute = t.holds(callee)
        if not found:
          continue  # an async computation, not a collective
        assert len(found) == 1 and not compute, i["line"]
        kind, nbytes = found[0]["op"], _bytes(found[0]["shape"])
      elif done is not None:
        nbytes = _bytes(instrs[done]["shape"])
      else:
        nbytes = _bytes(_tuple_elements(i["shape"])[-1])
      assert kind in COLLECTIVES, i["line"]
      collectives[i["name"]] = (kind, nbytes, runs, _window(t, instrs, k, done))
  return collectives, sorted(copies)


def _chain_done(t, instrs, k, users):
  """The done fusion a chain's state reaches from instrs[k], in this
  computation (through element reads and continuations)."""
  todo, seen = [instrs[k]["name"]], set()
  while todo:
    name = todo.pop()
    for j in users.get(name, []):
      role = t.chain_role(instrs[j])
      if role == "done":
        return j
      if j not in seen and (role == "continuation" or
                            instrs[j]["op"] == "get-tuple-element"):
        seen.add(j)
        todo.append(instrs[j]["name"])
  return None


def _window(t, instrs, k, done):
  if done is None or done < k:
    return None
  return sum(t.is_compute(i) for i in instrs[k + 1:done])


# --- what the inspector reads ---------------------------------------------------

def read(path):
  report = OverlapReport.from_hlo(path)
  collectives = {}
  for c in report.collectives:
    assert c.start not in collectives, f"two rows for {c.start}"
    collectives[c.start] = (c.kind, c.bytes, c.runs, len(c.overlapped))
  copies = sorted((c.start, c.bytes, c.runs) for c in report.copies)
  return report, collectives, copies


def _fixture_id(p):
  return p.name


#: On older jax the sweeps over every fixture read only the fixtures that
#: jax's compilers made (reading is pure Python: the jax that runs the
#: reader does not change what it reads; CI's budget). The narrower sweeps
#: run whole.
_SWEEPS = ("test_every_real_fixture_reads_as_an_independent_count_says",
           "test_a_dump_and_the_as_text_of_one_compile_read_the_same",
           "test_async_start_form_is_read_by_what_it_wraps",
           "test_source_lines_come_from_the_stack_frame_tables")
pytestmark = pytest.mark.newest_jax(older_jax=[
    *(f"{test}[*jax{jax.__version__}*]" for test in _SWEEPS),
    "test_tpu_async_collective_fusion_chain_is_one_overlapping_collective",
    "test_loops_without_known_trip_count_are_counted_from_their_condition",
    "test_an_async_slice_is_an_async_copy_in_both_forms",
    "test_every_async_slice_of_a_real_fixture_is_a_copy"])


@pytest.mark.parametrize("path", FIXTURES, ids=_fixture_id)
def test_every_real_fixture_reads_as_an_independent_count_says(path):
  expected, expected_copies = count_from_text(path.read_text())
  report, got, copies = read(path)
  assert expected, "no collective found: the count here does not read this form"
  for name, (kind, nbytes, runs, window) in expected.items():
    if window is None and name in got:  # a window across computations
      got[name] = got[name][:3] + (None,)
  assert got == expected
  assert [(n, b if b is not None else c_b, r) for (n, b, r), (_, c_b, _) in
          zip(expected_copies, copies)] == copies
  assert len(expected_copies) == len(copies)
  # With no hardware named, the profile follows the platform the file's
  # maker compiled for (its name says it; the text says it by its marks).
  platform = re.match(r"(?:readers-)?(tpu|gpu|cpu)", path.name).group(1)
  assert report.hardware.name == ("tpu-v5e" if platform == "tpu" else "h100")
  said = {"tpu": "the default for a TPU dump", "gpu": "the default for a GPU "
          "dump", "cpu": "the dump does not say its platform"}[platform]
  assert any(said in n for n in report.notes), report.notes


@pytest.mark.parametrize("stem", sorted(PAIRS), ids=str)
def test_a_dump_and_the_as_text_of_one_compile_read_the_same(stem):
  dump, as_text = (OverlapReport.from_hlo(p) for p in PAIRS[stem])
  fields = ("kind", "start", "done", "bytes", "group_size", "runs", "async",
            "made_blocking", "trip_count", "comm_s", "exposed_s", "flags")

  def rows(report):
    return sorted(
        (tuple(c.to_dict()[k] for k in fields), len(c.overlapped))
        for c in report.collectives)
  assert rows(dump) == rows(as_text)
  assert sorted((c.bytes, c.runs) for c in dump.copies) == \
      sorted((c.bytes, c.runs) for c in as_text.copies)
  assert dump.totals == pytest.approx(as_text.totals)


def _with(pattern):
  return [p for p in FIXTURES if re.search(pattern, p.read_text(), re.M)]


@pytest.mark.parametrize("path", _with(r" async-start\(.*calls=%"), ids=_fixture_id)
def test_async_start_form_is_read_by_what_it_wraps(path):
  """GPU: `%all-gather-start = ... async-start(...), calls=%async_computation`
  is an all-gather pair, as `as_text()`'s `all-gather-start(` is: its kind is
  that of the one collective its computation holds (GPU also wraps a fused
  all-reduce so: `%fusion-start`), and it is async. TPU: an `async-start` of
  a lone slice is an async copy (`as_text()`'s `slice-start`)."""
  text = path.read_text()
  t = Text(text)
  report = OverlapReport.from_hlo(path)
  by_start = {c.start: c for c in report.collectives}
  copies = {c.start for c in report.copies}
  for comp in t.schedules():
    for i in t.comps[comp]:
      if i["op"] != "async-start":
        continue
      callee = t.callee(i, "calls")
      found, compute = t.holds(callee)
      wrapped = [x["op"] for x in t.comps[callee]
                 if x["op"] not in ("parameter", "tuple", "get-tuple-element")]
      if len(found) == 1 and not compute:
        assert by_start[i["name"]].kind == found[0]["op"]
        # async unless the backend made it synchronous (older jax's GPU pairs)
        is_sync = '"is_sync":true' in i["line"]
        assert by_start[i["name"]].is_async == (not is_sync)
        assert by_start[i["name"]].made_blocking == is_sync
      elif wrapped in (["slice"], ["dynamic-slice"]):  # TPU: an async slice
        assert i["name"] in copies and i["name"] not in by_start
      else:
        assert i["name"] not in by_start


@pytest.mark.parametrize("path", _with(r"AsyncCollectiveStart"), ids=_fixture_id)
def test_tpu_async_collective_fusion_chain_is_one_overlapping_collective(path):
  text = path.read_text()
  report = OverlapReport.from_hlo(path)
  chains = [c for c in report.collectives if c.start.startswith("async-collective-start")]
  starts = re.findall(r"^\s*%(async-collective-start[\w.]*) = ", text, re.M)
  continuations = re.findall(r"^\s*%(\S+) = .*\"continuation_config\"", text, re.M)
  assert sorted(c.start for c in chains) == sorted(starts)
  for c in chains:
    assert c.is_async and not c.made_blocking and c.done.startswith("async-collective-done")
  # every continuation's fused compute is in a chain's window, and none of the
  # chain's own fusions is a row of its own
  assert set(continuations) <= {n for c in chains for n in c.overlapped}
  names = {c.start for c in report.collectives} | {c.done for c in report.collectives}
  assert not names & set(continuations)
  assert not [c for c in report.collectives
              if c.made_blocking and "async-collective" in (c.start + c.done)]
  # what the model is handed: each continuation, its chain, and the compute
  # fused into it (a dot or convolution in these fixtures)
  from jax_overlap._src.inspection.reading.hlo_text import load_hlo  # noqa: PLC0415
  from jax_overlap._src.inspection.schedule import async_fusions  # noqa: PLC0415
  from jax_overlap._src.inspection.schedule.pairing import read_schedule  # noqa: PLC0415
  module = load_hlo(path)
  schedule = read_schedule(module)
  assert sorted(n for _, n in schedule.continuations) == sorted(continuations)
  for (comp, name), pairs in schedule.continuations.items():
    assert [p.start.name for p in pairs][0].startswith("async-collective-start")
    fused = async_fusions.fused_compute(module.computations[comp].by_name[name], module)
    assert re.search(rf"%(?:{'|'.join(map(re.escape, fused))}) = \S+ "
                     r"(?:convolution|dot)\(", text)


@pytest.mark.parametrize("path", _with(r"^\s*%\S+ = .* while\((?!.*known_trip_count)"),
                         ids=_fixture_id)
def test_loops_without_known_trip_count_are_counted_from_their_condition(path):
  report = OverlapReport.from_hlo(path)
  in_loops = [c for c in report.collectives if c.runs != 1]
  assert in_loops, "every collective ran once: the loops were not counted"
  assert not [c for c in report.collectives if c.loop and c.trip_count is None]


# XLA on TPU writes async slices where it prefetches a large buffer into VMEM
# in slices: readers-tpu_demo_step (the demo's transformer) has them; small
# programs did not. The same form, small: the start line below is as TPU's
# as_text() wrote it (jax 0.12.0.1, libtpu 0.0.52, shapes cut down); the dump
# writes the same op as an `async-start` of a slice.
_SLICE_AS_TEXT = """HloModule m, is_scheduled=true, num_partitions=8
ENTRY %main (p: bf16[4,16,128]) -> bf16[1,16,128] {
  %p = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %slice-start.20 = ((bf16[4,16,128]{2,1,0:T(8,128)(2,1)}), bf16[1,16,128]{2,1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:1], [0:16], [0:128]}, backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"dma_priority":1}
  %n = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} negate(%p)
  %f = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} fusion(%n), kind=kLoop, calls=%neg
  ROOT %slice-done.20 = bf16[1,16,128]{2,1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.20), backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"dma_priority":1}
}
%neg (q: bf16[4,16,128]) -> bf16[4,16,128] {
  %q = bf16[4,16,128]{2,1,0} parameter(0)
  ROOT %r = bf16[4,16,128]{2,1,0} negate(%q)
}"""
_SLICE_DUMP = """HloModule m, is_scheduled=true, num_partitions=8
%async_computation (a: bf16[4,16,128]) -> bf16[1,16,128] {
  %a = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  ROOT %s = bf16[1,16,128]{2,1,0:T(8,128)(2,1)S(1)} slice(%a), slice={[0:1], [0:16], [0:128]}
}
ENTRY %main (p: bf16[4,16,128]) -> bf16[1,16,128] {
  %p = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %slice-start.20 = ((bf16[4,16,128]{2,1,0:T(8,128)(2,1)}), bf16[1,16,128]{2,1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) async-start(%p), calls=%async_computation, backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"dma_priority":1}
  %n = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} negate(%p)
  %f = bf16[4,16,128]{2,1,0:T(8,128)(2,1)} fusion(%n), kind=kLoop, calls=%neg
  ROOT %slice-done.20 = bf16[1,16,128]{2,1,0:T(8,128)(2,1)S(1)} async-done(%slice-start.20), backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"dma_priority":1}
}
%neg (q: bf16[4,16,128]) -> bf16[4,16,128] {
  %q = bf16[4,16,128]{2,1,0} parameter(0)
  ROOT %r = bf16[4,16,128]{2,1,0} negate(%q)
}"""


@pytest.mark.parametrize("text", [_SLICE_AS_TEXT, _SLICE_DUMP], ids=["as_text", "dump"])
def test_an_async_slice_is_an_async_copy_in_both_forms(text):
  report = OverlapReport.from_hlo(text)
  assert [(c.start, c.done, c.bytes, c.runs) for c in report.copies] == [
      ("slice-start.20", "slice-done.20", 1 * 16 * 128 * 2, 1)]
  assert not report.collectives
  assert count_from_text(text)[1] == [("slice-start.20", 4096, 1)]  # ours agrees


@pytest.mark.parametrize("path", _with(r"^\s*%slice-start[\w.]* = "), ids=_fixture_id)
def test_every_async_slice_of_a_real_fixture_is_a_copy(path):
  starts = re.findall(r"^\s*%(slice-start[\w.]*) = ", path.read_text(), re.M)
  report = OverlapReport.from_hlo(path)
  assert sorted(c.start for c in report.copies if c.start.startswith("slice-start")) \
      == sorted(starts)


@pytest.mark.parametrize("path", _with(r"\nStackFrames\n"), ids=_fixture_id)
def test_source_lines_come_from_the_stack_frame_tables(path):
  """jax 0.10.2+ dumps name source lines only through `stack_frame_id`: each
  collective's `where` is the innermost frame outside jax and this library,
  resolved here by hand from the text's tables."""
  text = path.read_text()

  def table(name):
    block = re.search(rf"\n{name}\n((?:\d+ .*\n)+)", text)
    return dict(re.match(r"(\d+) (.*)", row).groups() for row in block.group(1).splitlines())
  files = {k: v.strip('"') for k, v in table("FileNames").items()}
  locations = {k: (files[re.search(r"file_name_id=(\d+)", v).group(1)],
                   re.search(r"\bline=(\d+)", v).group(1))
               for k, v in table("FileLocations").items()}
  frames = {k: (re.search(r"file_location_id=(\d+)", v).group(1),
                re.search(r"parent_frame_id=(\d+)", v).group(1))
            for k, v in table("StackFrames").items()}

  def expected(frame):
    chain, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      chain.append(locations[frames[frame][0]])
      frame = frames[frame][1]
    mine = [c for c in chain if not re.search(r"(^|/)(jax|jaxlib|jax_overlap)/", c[0])]
    return "%s:%s" % (mine or chain)[0]
  report = OverlapReport.from_hlo(path)
  starts = {m.group(1): m.group(2) for m in re.finditer(
      r"^\s*(?:ROOT )?%([\w.\-]+) = .*?stack_frame_id=(\d+)", text, re.M)}
  checked = 0
  for c in report.collectives:
    if c.start in starts:
      assert c.where == expected(starts[c.start]), c
      checked += 1
  assert checked or not report.collectives
