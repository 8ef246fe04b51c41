"""mesh_axes reads a collective's mesh axes from each form of its groups."""

import pytest

import mesh_axes

SHAPE, NAMES = (2, 2, 2), ("pp", "fsdp", "tp")


@pytest.mark.parametrize("line, axes", [
    # a permute between the two halves of the mesh: over 'pp'
    ("%p = f32[4] collective-permute(%x), source_target_pairs={{0,4},{1,5},{2,6},{3,7}}",
     {"pp"}),
    # iota groups of consecutive pairs: the last axis
    ("%g = f32[8] all-gather(%x), replica_groups=[4,2]<=[8], dimensions={0}", {"tp"}),
    # transposed iota: pairs 2 apart, the middle axis
    ("%g = f32[8] all-gather(%x), replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}",
     {"fsdp"}),
    ("%r = f32[8] all-reduce(%x), replica_groups={{0,2},{1,3},{4,6},{5,7}}, to_apply=%add",
     {"fsdp"}),
    ("%r = f32[8] all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add",
     {"pp", "fsdp", "tp"}),
])
def test_groups_name_their_axes(line, axes):
  assert mesh_axes.axes_of(mesh_axes.groups_of(line), SHAPE, NAMES) == axes


def test_mesh_groups_name_their_axes_themselves():
  line = "%r = f32[8] all-reduce(%x), replica_groups=mesh['pp'=2,'fsdp'=2,'tp'=2] {'fsdp','tp'}"
  assert mesh_axes.named_axes(line) == {"fsdp", "tp"}
  assert mesh_axes.named_axes("%r = f32[8] all-reduce(%x), replica_groups={}") is None
