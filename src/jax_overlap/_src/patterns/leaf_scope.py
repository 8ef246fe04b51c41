"""How a pattern names what each of its collectives moves, for the report.

`fsdp_scan` and collective matmul start their collectives inside
`moving(name)`, a `jax.named_scope` whose name is `jax_overlap.leaf=<name>`
(`name` is the leaf's pytree path, e.g. "['w1']", or "x" for what a ring
moves). jax writes the name stack into each instruction's
`metadata={op_name="..."}`, so the name survives into the compiled HLO and a
dump made on a cluster; `leaf_from_op_name` reads it back.
"""

from __future__ import annotations

import jax

PREFIX = "jax_overlap.leaf="


def moving(name: str):
  """A `jax.named_scope` saying that the collectives started inside it move
  `name`. '/' separates scopes in op_name, and an '@' cuts the name stack short
  where jax writes it into MLIR locations (the rest of op_name, the primitive
  included, is lost), so both (and '%') are escaped."""
  escaped = name.replace("%", "%25").replace("/", "%2F").replace("@", "%40")
  return jax.named_scope(PREFIX + escaped)


def moving_leaf(path):
  """`moving` for a leaf at pytree `path` (as `tree_map_with_path` gives)."""
  return moving(jax.tree_util.keystr(path) or "()")


def leaf_from_op_name(op_name: str) -> str | None:
  """The innermost leaf named in `op_name` (a name stack), None if none."""
  found = None
  for scope in op_name.split("/"):
    if scope.startswith(PREFIX):
      found = scope[len(PREFIX):]
  if found is None:
    return None
  return found.replace("%40", "@").replace("%2F", "/").replace("%25", "%")
