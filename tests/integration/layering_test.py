"""The library's layers, read from its source (no import runs).

- `_src` never imports the public `jax_overlap` package: a cycle through
  `__init__.py` that works only by the order of its lines;
- `ordering/` imports nothing from `patterns/` (patterns are built on it);
- the module-level imports between `_src` modules form no cycle.
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MODULES = sorted((SRC / "jax_overlap" / "_src").rglob("*.py"))


def _name(path: pathlib.Path) -> str:
  parts = path.relative_to(SRC).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, top_level_only: bool = False):
  """(line, module, names) for each import of `path` (names: those of a
  `from module import ...`, else ()); with `top_level_only`, those run when
  the module is imported (not inside a function)."""
  tree = ast.parse(path.read_text(), str(path))
  package = _name(path) if path.name == "__init__.py" else \
      _name(path).rpartition(".")[0]
  nodes = tree.body if top_level_only else ast.walk(tree)
  for node in nodes:
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name, ()
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        up = parts[:len(parts) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      yield node.lineno, base, tuple(a.name for a in node.names)


def test_there_are_modules_to_read():
  assert len(MODULES) > 50


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _name(p))
def test_src_never_imports_the_public_package(path):
  bad = [f"line {n}: {m}" for n, m, _ in _imports(path) if m == "jax_overlap"]
  assert not bad, f"{_name(path)} imports jax_overlap itself: {bad}"


def test_ordering_imports_nothing_from_patterns():
  bad = [f"{_name(p)} line {n}: {m}"
         for p in MODULES if "ordering" in p.parts
         for n, m, _ in _imports(p) if m.startswith("jax_overlap._src.patterns")]
  assert not bad, bad


def test_no_import_cycle_between_src_modules():
  names = {_name(p): p for p in MODULES}
  graph = {}
  for name, path in names.items():
    deps = set()
    for _, m, imported in _imports(path, top_level_only=True):
      # `from pkg import module` imports pkg.module; `from module import f`
      # the module itself
      for target in [f"{m}.{i}" for i in imported if f"{m}.{i}" in names] \
          or [m]:
        if target in names and target != name:
          deps.add(target)
    graph[name] = deps
  state, stack = {}, []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for d in sorted(graph[n]):
      if state.get(d) == "open":
        cycle = stack[stack.index(d):] + [d]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if d not in state:
        visit(d)
    stack.pop()
    state[n] = "done"

  for n in sorted(graph):
    if n not in state:
      visit(n)
