"""Reading HLO text: shapes, comments, split lines, attributes, and errors that
name the line."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_overlap import HloParseError, OverlapReport
from jax_overlap._src.inspection.reading import attributes
from jax_overlap._src.inspection.reading import lexing
from jax_overlap._src.inspection.reading.hlo_text import (
    load_hlo, parse_hlo_text, parse_instruction)
from jax_overlap._src.inspection.reading.shapes import shape_from_text

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hlo"
GOOD = ["gpu_prefetch.txt", "gpu_async_wrapped.txt", "tpu_loop.txt",
        "gpu_pipelined_send_recv.txt", "threads_and_copies.txt",
        "sync_collectives.txt"]


# --- shapes -----------------------------------------------------------------

@pytest.mark.parametrize("text, dims, nbytes, space", [
    ("f32[8,128]{1,0}", (8, 128), 4096, None),
    ("f32[8,128]{1,0:T(8,128)S(1)}", (8, 128), 4096, 1),
    ("bf16[1024]{0:T(1024)(128)(2,1)}", (1024,), 2048, None),
    ("s32[]{:T(128)}", (), 4, None),
    ("u32[]{:S(2)}", (), 4, 2),
    ("f32[<=8,16]", (8, 16), 512, None),
    ("f8e4m3fn[64]{0}", (64,), 64, None),
    ("s4[64]{0}", (64,), 32, None),
    ("pred[3]", (3,), 3, None),
    ("token[]", (), 0, None),
])
def test_array_shapes(text, dims, nbytes, space):
  shape = shape_from_text(text)
  assert (shape.dims, shape.bytes, shape.memory_space) == (dims, nbytes, space)


def test_tuple_shapes_with_index_comments():
  text = lexing.strip_comments(
      "(s32[], (f32[2]{0}, u32[]), token[], f32[1], f32[1], /*index=5*/f32[4])")
  shape = shape_from_text(text)
  assert shape.is_tuple and len(shape.elements) == 6
  assert shape.bytes == 4 + 8 + 4 + 0 + 4 + 4 + 16
  assert shape_from_text("()").elements == ()


@pytest.mark.parametrize("bad", ["f33[8]", "f32[8", "(f32[8], ", "f32"])
def test_bad_shapes_raise_value_error(bad):
  with pytest.raises(ValueError):
    shape_from_text(bad)


# --- instructions -----------------------------------------------------------

def test_typed_and_untyped_operands_and_attributes():
  i = parse_instruction(
      '%all-gather-done = bf16[1024,1024]{1,0} all-gather-done('
      '(bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) %all-gather-start), '
      'metadata={op_name="a, b // not a comment" source_line=3}, '
      'backend_config={"x":{"y":[1,2]}}')
  assert (i.name, i.opcode, i.operands) == (
      "all-gather-done", "all-gather-done", ("all-gather-start",))
  assert attributes.op_name(i) == "a, b // not a comment"
  assert attributes.backend_config(i) == {"x": {"y": [1, 2]}}
  j = parse_instruction("ROOT t = (f32[2], f32[2]) tuple(a, b.1)")
  assert j.is_root and j.operands == ("a", "b.1")


def test_constants_and_parameters_keep_their_literal():
  c = parse_instruction("%c = f32[3]{0} constant({1, 2, 3})")
  assert c.operands == () and c.operand_text == "{1, 2, 3}"
  p = parse_instruction("%p = f32[3]{0} parameter(2)")
  assert p.operand_text == "2"


def test_backend_config_in_an_escaped_string_and_trip_counts():
  i = parse_instruction(
      '%w = (s32[]) while(%t), condition=%c, body=%b, backend_config='
      '"{\\"known_trip_count\\":{\\"n\\":\\"12\\"}}"')
  assert attributes.known_trip_count(i) == 12
  j = parse_instruction('%w = (s32[]) while(%t), condition=%c, body=%b, '
                        'backend_config={"known_trip_count":{"n":"7"}}')
  assert attributes.known_trip_count(j) == 7
  k = parse_instruction('%w = (s32[]) while(%t), condition=%c, body=%b, '
                        'backend_config="\\n\\000\\022\\004"')
  assert attributes.known_trip_count(k) is None


def test_instructions_split_over_lines_and_comments():
  module = parse_hlo_text("""HloModule m, is_scheduled=true
// a comment before the computation
ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)   // trailing comment
  %n = f32[8]{0}
      negate(%p), metadata={op_name="x//y"}
  %call-start = ((f32[8]{0}), f32[8]{0}) call-start(%p),
    async_execution_thread="t", to_apply=%f
  ROOT %d = f32[8]{0} call-done(%call-start)
}

%f (q: f32[8]) -> f32[8] {
  ROOT %q = f32[8]{0} parameter(0)
}, execution_thread="t"
""")
  main = module.entry
  assert [i.name for i in main.instructions] == ["p", "n", "call-start", "d"]
  assert main.by_name["n"].line_number == 5
  assert attributes.op_name(main.by_name["n"]) == "x//y"
  assert attributes.string_attribute(main.by_name["call-start"],
                                     "async_execution_thread") == "t"
  assert module.computations["f"].execution_thread == "t"


def test_live_text_location_tables_are_skipped():
  module = parse_hlo_text("""HloModule jit_f, is_scheduled=true

FileNames
1 "/tmp/f.py"

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main.1 (x: f32[2]) -> f32[2] {
  ROOT %x = f32[2]{0} parameter(0), metadata={op_name="x" stack_frame_id=1}
}
""")
  assert module.name == "jit_f" and module.entry.name == "main.1"


# --- errors -----------------------------------------------------------------

@pytest.mark.parametrize("name, line, reason", [
    ("malformed_unclosed.txt", 5, "a bracket opened in this instruction is "
                                  "never closed"),
    ("malformed_instruction.txt", 5, "expected an instruction"),
    ("malformed_shape.txt", 5, "cannot read the shape (unknown element type "
                               "'f33')"),
    ("malformed_operand.txt", 5, "operand %q is not defined in computation "
                                 "%main"),
    ("not_scheduled.txt", 1, "this module is not scheduled"),
    ("not_hlo.txt", 1, "expected 'HloModule <name>, ...' first"),
    ("truncated_mid_instruction.txt", 34, "this instruction is not finished "
                                          "when the text ends (truncated?)"),
    ("truncated.txt", 20, "computation %main.42_spmd is not closed when the "
                          "text ends at line 29 (truncated?)"),
])
def test_malformed_files_name_the_line(name, line, reason):
  path = FIXTURES / name
  with pytest.raises(HloParseError) as info:
    OverlapReport.from_hlo(path)
  e = info.value
  assert e.line_number == line
  assert e.reason.startswith(reason)
  assert e.line == path.read_text().split("\n")[line - 1].strip()
  assert str(e).startswith(f"{path}:{line}: {reason}")
  assert "\n" not in str(e)


def test_unreadable_and_empty_inputs():
  with pytest.raises(HloParseError, match="cannot read this file"):
    OverlapReport.from_hlo(FIXTURES / "no_such_dump.txt")
  with pytest.raises(HloParseError, match="the text is empty"):
    parse_hlo_text("\n\n")
  with pytest.raises(HloParseError, match="no ENTRY computation"):
    parse_hlo_text("HloModule m, is_scheduled=true\n%f {\n  ROOT %p = f32[] "
                   "parameter(0)\n}\n")
  with pytest.raises(HloParseError, match="while without body="):
    parse_hlo_text("HloModule m, is_scheduled=true\nENTRY %e {\n  %t = (s32[])"
                   " parameter(0)\n  ROOT %w = (s32[]) while(%t), "
                   "condition=%e\n}\n")


def test_text_and_path_are_both_accepted():
  path = FIXTURES / "gpu_prefetch.txt"
  by_path = load_hlo(path)
  by_str_path = load_hlo(str(path))
  by_text = load_hlo(path.read_text())
  assert by_path.source == str(path) and by_text.source == "<text>"
  assert [i.name for i in by_path.entry.instructions] == \
      [i.name for i in by_text.entry.instructions] == \
      [i.name for i in by_str_path.entry.instructions]


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(GOOD), data=st.data())
def test_damaged_dumps_fail_with_our_error_only(name, data):
  text = (FIXTURES / name).read_text()
  cut = data.draw(st.integers(0, len(text)))
  how = data.draw(st.sampled_from(["truncate", "delete", "insert"]))
  if how == "truncate":
    damaged = text[:cut]
  elif how == "delete":
    damaged = text[:cut] + text[cut + data.draw(st.integers(1, 40)):]
  else:
    damaged = text[:cut] + data.draw(st.sampled_from(
        ["(", ")", "{", "}", ",", "\n", "%", '"', "=", "-done", "ROOT "])) + \
        text[cut:]
  try:
    OverlapReport.from_hlo(damaged + "\n")
  except HloParseError as e:
    assert e.line_number >= 0 and "\n" not in str(e)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(GOOD), data=st.data())
def test_odd_backend_config_values_are_read_or_ignored(name, data):
  text = (FIXTURES / name).read_text()
  spots = [i + 2 for i in range(len(text)) if text.startswith('":', i)]
  if not spots:
    return
  i = data.draw(st.sampled_from(spots))
  j = i
  while j < len(text) and text[j] not in ",}":
    j += 1
  value = data.draw(st.sampled_from(
      ['"x"', "[]", "{}", "-1", "null", "true", '["1"]', '[["a"]]', "1e400"]))
  try:
    OverlapReport.from_hlo(text[:i] + value + text[j:])
  except HloParseError:
    pass
