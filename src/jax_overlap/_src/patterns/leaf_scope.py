"""How a pattern names what each of its collectives moves, for the report.

`fsdp_scan` and collective matmul start their collectives inside
`moving(name)`, a `jax.named_scope` whose name is `jax_overlap.leaf=<name>`
(`name` is the leaf's pytree path, e.g. "['w1']", or "x" for what a ring
moves). jax writes the name stack into each instruction's
`metadata={op_name="..."}`, so the name survives into the compiled HLO and a
dump made on a cluster; `leaf_from_op_name` reads it back.

A pattern that runs a printable plan (`jax_overlap.fsdp_plan`) also starts
each step's collectives inside `in_step(label)` (`jax_overlap.step=<label>`),
so the report names the plan step a collective is in flight across;
`step_from_op_name` reads it back (tests/inspection/plan_step_test.py).
"""

from __future__ import annotations

import jax

PREFIX = "jax_overlap.leaf="
STEP_PREFIX = "jax_overlap.step="


def _escape(name: str) -> str:
  return name.replace("%", "%25").replace("/", "%2F").replace("@", "%40")


def _unescape(name: str) -> str:
  return name.replace("%40", "@").replace("%2F", "/").replace("%25", "%")


def moving(name: str):
  """A `jax.named_scope` saying that the collectives started inside it move
  `name`. '/' separates scopes in op_name, and an '@' cuts the name stack short
  where jax writes it into MLIR locations (the rest of op_name, the primitive
  included, is lost), so both (and '%') are escaped."""
  return jax.named_scope(PREFIX + _escape(name))


def moving_leaf(path):
  """`moving` for a leaf at pytree `path` (as `tree_map_with_path` gives)."""
  return moving(jax.tree_util.keystr(path) or "()")


def in_step(label: str):
  """A `jax.named_scope` saying that the collectives started inside it belong
  to the plan step `label` (escaped as in `moving`)."""
  return jax.named_scope(STEP_PREFIX + _escape(label))


def _innermost(op_name: str, prefix: str) -> str | None:
  found = None
  for scope in op_name.split("/"):
    if scope.startswith(prefix):
      found = scope[len(prefix):]
  return None if found is None else _unescape(found)


def leaf_from_op_name(op_name: str) -> str | None:
  """The innermost leaf named in `op_name` (a name stack), None if none."""
  return _innermost(op_name, PREFIX)


def step_from_op_name(op_name: str) -> str | None:
  """The innermost plan step named in `op_name`, None if none."""
  return _innermost(op_name, STEP_PREFIX)
