"""What an fsdp transfer offers (patterns/fsdp/transfer_protocol.py): each
transfer class satisfies its protocols, and no fsdp module calls a private
method or function of another's (read from the source, no import runs)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from jax_overlap._src.patterns.fsdp.explicit_futures import FutureReshardTransfer
from jax_overlap._src.patterns.fsdp.layer_inputs import PairTransfer
from jax_overlap._src.patterns.fsdp.transfer import (ReshardTransfer,
                                                     ShardMapTransfer)
from jax_overlap._src.patterns.fsdp.transfer_protocol import (FutureTransfer,
                                                              Transfer,
                                                              TwoStageTransfer)

FSDP = (pathlib.Path(__file__).resolve().parents[3] / "src" / "jax_overlap"
        / "_src" / "patterns" / "fsdp")


def _transfers():
  futures = ShardMapTransfer("x", [0, None])
  return {
      "shard_map": (futures, {Transfer, TwoStageTransfer, FutureTransfer}),
      "reshard": (ReshardTransfer(("x",), {}), {Transfer}),
      "future_reshard": (FutureReshardTransfer(("x",), {}),
                         {Transfer, FutureTransfer}),
      "pair": (PairTransfer(futures), {Transfer, TwoStageTransfer}),
  }


@pytest.mark.parametrize("name", sorted(_transfers()))
def test_each_transfer_offers_its_protocols(name):
  transfer, protocols = _transfers()[name]
  for protocol in (Transfer, TwoStageTransfer, FutureTransfer):
    assert isinstance(transfer, protocol) == (protocol in protocols), protocol
  assert transfer.stages in (1, 2) and isinstance(transfer.in_shard_map, bool)


def _private_defs(tree) -> set[str]:
  return {n.name for n in ast.walk(tree)
          if isinstance(n, (ast.FunctionDef, ast.ClassDef))
          and n.name.startswith("_") and not n.name.startswith("__")}


def _foreign_private_uses(sources: dict[str, str]) -> list[str]:
  """'module line: name' for each private name of one module used by
  another: imported from it, or called as a method on anything but `self`
  or `cls`."""
  trees = {m: ast.parse(s) for m, s in sources.items()}
  defined = {m: _private_defs(t) for m, t in trees.items()}
  everywhere = set().union(*defined.values())
  found = []
  for m, tree in trees.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and \
          (node.module or "").rpartition(".")[2] in sources:
        found += [f"{m} line {node.lineno}: {a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__")]
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in everywhere
            and not (isinstance(node.func.value, ast.Name)
                     and node.func.value.id in ("self", "cls"))):
        found.append(f"{m} line {node.lineno}: {node.func.attr}")
  return found


def test_no_fsdp_module_uses_another_modules_private_names():
  sources = {p.stem: p.read_text() for p in sorted(FSDP.glob("*.py"))}
  assert len(sources) > 10
  assert _foreign_private_uses(sources) == []


def test_a_private_method_called_across_modules_is_found():
  sources = {
      "a": "class A:\n  def _start(self):\n    return 1\n",
      "b": "def go(transfer):\n  return transfer._start()\n",
      "c": "from a import _helper\nfrom x import _compat\n",
  }
  assert _foreign_private_uses(sources) == ["b line 2: _start",
                                            "c line 1: _helper"]
