"""The report's records of a pattern's collectives: `where` is the user's
line (or None, never ''), and `leaf` names what each collective moves."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap import OverlapReport, all_gather_matmul, fsdp_scan, matmul_reduce_scatter
from jax_overlap._src.patterns.leaf_scope import leaf_from_op_name, moving

# fsdp_scan packs a layer's leaves into one bucket (bucket=True, the
# default): its collectives are named after the bucket's leaves together;
# with bucket=False, one collective per leaf, each named after its leaf.
LEAVES = {"['w1']+['w2']"}
PER_LEAF = {"['w1']", "['w2']"}
# Layer 0, the stack's end, travels in groups by use order (w1, then w2
# after the matmul on w1: patterns/fsdp/use_order.py), each group named
# after its leaves.
GROUPS = LEAVES | PER_LEAF


def _mesh():
  return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _layer(x, w):
  return x + jnp.tanh(x @ w["w1"]) @ w["w2"]


def _fsdp_model(bucket=True):
  @jax.shard_map(mesh=_mesh(), in_specs=(P("d"), P(None, "d")), out_specs=P("d"))
  def model(x, params):
    return fsdp_scan(_layer, x, params, axis="d", bucket=bucket)  # reported
  return model


FSDP_LINE = f"{__file__}:{_fsdp_model.__code__.co_firstlineno + 3}"
X = jnp.ones((16, 8))
PARAMS = {"w1": jnp.ones((3, 8, 8)) / 8, "w2": jnp.ones((3, 8, 8)) / 8}


def _check_where(records):
  for r in records:
    assert r.where is None or not r.where.startswith(
        jo.__file__.rsplit("/", 1)[0]), r
    assert r.where != ""


def test_forward_prefetches_in_the_scan_body_name_the_users_line():
  report = jo.overlap_report(jax.jit(_fsdp_model()),
                             schedule="written")(X, PARAMS)
  in_body = [c for c in report.collectives if c.computation != "main"]
  assert in_body, "the scan body prefetches the next layer"
  for record in report.collectives:
    assert record.where == FSDP_LINE, record
    assert record.leaf in GROUPS
  assert {c.leaf for c in in_body} == LEAVES   # the loop's layers: buckets
  for w in report.written:
    assert w.where and w.where.startswith(FSDP_LINE), w
    assert w.leaf in GROUPS


@pytest.mark.parametrize("bucket", [True, False])
def test_gradient_records_name_their_leaf_written_and_compiled(bucket):
  model = _fsdp_model(bucket)
  leaves = LEAVES if bucket else PER_LEAF
  step = jax.jit(jax.grad(lambda x, p: model(x, p).sum(), 1))
  written = jo.overlap_report(step, schedule="written")(X, PARAMS)
  kinds = {(c.kind, c.leaf) for c in written.collectives}
  named = GROUPS if bucket else PER_LEAF
  assert {(k, leaf) for k in ("all-gather", "reduce-scatter")
          for leaf in leaves} <= kinds <= {
              (k, leaf) for k in ("all-gather", "reduce-scatter")
              for leaf in named}, kinds
  assert all(c.where == FSDP_LINE for c in written.collectives)
  compiled = jo.overlap_report(step, schedule="compiled")(X, PARAMS)
  assert compiled.collectives
  assert leaves <= {c.leaf for c in compiled.collectives} <= named  # op_name
  _check_where(compiled.collectives)
  data = written.to_dict()
  assert [c["leaf"] for c in data["collectives"]] == \
      [c.leaf for c in written.collectives]
  assert list(data["collectives"][0])[:6] == [
      "kind", "start", "done", "computation", "where", "leaf"]
  assert "['w1']" in str(written) and "['w2']" in str(written)


def test_collective_matmul_records_name_what_the_ring_moves():
  @jax.jit
  @jax.shard_map(mesh=_mesh(), in_specs=(P("d"), P(None, "d"), P("d")),
                 out_specs=P("d"))
  def mlp(x, w1, w2):
    h = all_gather_matmul(x, w1, "d")
    return matmul_reduce_scatter(jnp.tanh(h), w2, "d")

  args = (jnp.ones((16, 8)), jnp.ones((8, 16)) / 8, jnp.ones((16, 8)) / 16)
  forward = jo.overlap_report(mlp, schedule="written")(*args)
  assert {c.leaf for c in forward.collectives} == {"x", "x @ w"}
  grad = jo.overlap_report(
      jax.jit(jax.grad(lambda *a: mlp(*a).sum(), (0, 1, 2))),
      schedule="written")(*args)
  assert {c.leaf for c in grad.collectives} == {"x", "x @ w", "dy", "dy @ w.T"}
  for c in forward.collectives + grad.collectives:
    assert c.kind == "collective-permute"
    assert c.where and __file__ in c.where, c


def test_leaf_is_read_from_a_dumps_op_name_and_none_when_absent():
  report = OverlapReport.from_hlo(r'''HloModule m, is_scheduled=true, num_partitions=2
ENTRY %main (p: f32[4]) -> f32[8] {
  %p = f32[4]{0} parameter(0)
  %ag = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(f)/jax_overlap.leaf=['a%2Fb']/while/body/collective_start" source_file="model.py" source_line=7}
  %ag2 = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(f)/all_gather"}
  ROOT %t = f32[8]{0} add(%ag, %ag2)
}''')
  assert [(c.leaf, c.where) for c in report.collectives] == [
      ("['a/b']", "model.py:7"), (None, None)]


@pytest.mark.parametrize("name", ["['w1']", "x @ w", "a/b%2F", ""])
def test_leaf_scope_round_trips(name):
  with moving(name) as _:
    pass
  from jax._src import source_info_util  # noqa: PLC0415
  with moving(name):
    stack = str(source_info_util.current_name_stack())
  assert leaf_from_op_name(f"jit(f)/{stack}/all_gather_start") == name


@pytest.mark.parametrize("name", ["x @ w", "dy @ w.T", "['w1']"])
def test_leaf_scope_keeps_the_compiled_op_name_whole(name):
  # An '@' in a name scope cut the compiled op_name short (jax writes name
  # stacks into MLIR locations), losing the primitive the inspector reads.
  def f(x):
    with moving(name):
      return jnp.dot(x, x)
  text = jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text()
  # (HLO text escapes quotes inside a string; the inspector's reader undoes it.)
  names = [n.replace("\\'", "'") for n in
           re.findall(r'op_name="([^"]*dot_general[^"]*)"', text)]
  assert names, re.findall(r'op_name="([^"]*)"', text)
  assert {leaf_from_op_name(n) for n in names} == {name}
