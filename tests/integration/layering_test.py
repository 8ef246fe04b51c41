"""The library's layers, read from its source (no import runs).

- `_src` never imports the public `jax_overlap` package: a cycle through
  `__init__.py` that works only by the order of its lines;
- each module imports only from its own layer or the layers below it
  (`LAYERS`: the trace-level halves of ordering and collectives, then
  `xla/`, what XLA gets, then the patterns);
- the imports between `_src` modules form no cycle, those inside functions
  included (an import moved into a function to get past a cycle is still
  one: `test_a_cycle_through_a_function_level_import_is_found`).
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MODULES = sorted((SRC / "jax_overlap" / "_src").rglob("*.py"))

#: The layers of `_src`, lowest first: a module imports only from its own
#: layer and those below. Keys are folders (or top-level modules) of `_src`,
#: or single modules placed apart from their folder.
LAYERS = [
    # version differences (and the probes that find some); how our
    # primitives run in an eager shard_map
    {"_compat", "probes", "eager_shard_map"},
    # program_order while tracing: the primitive, its rules, the barriers
    {"ordering"},
    # the futures while tracing (and the table of compiler quirks they and
    # xla/ consult; it names not_async's warning)
    {"collectives", "quirks"},
    # what XLA gets: lowering of ordered blocks and futures, module
    # rewrites, compile options, GPU ties, the compile hook
    {"xla"},
    # the public faces of ordering and collectives: they import the xla/
    # modules that register their lowering and compile hook
    {"ordering.decorator", "ordering.interleave", "collectives.api",
     "collectives.broadcast"},
    {"patterns"},
    {"inspection", "testing"},
    {"demo", "cli"},
]


def _name(path: pathlib.Path, src: pathlib.Path = SRC) -> str:
  parts = path.relative_to(src).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, top_level_only: bool = False,
             src: pathlib.Path = SRC):
  """(line, module, names) for each import of `path` (names: those of a
  `from module import ...`, else ()); with `top_level_only`, those run when
  the module is imported (not inside a function)."""
  tree = ast.parse(path.read_text(), str(path))
  package = _name(path, src) if path.name == "__init__.py" else \
      _name(path, src).rpartition(".")[0]
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


def _layer(name: str) -> int:
  """The index in `LAYERS` of module `name` (a `jax_overlap._src` module)."""
  rest = name.split(".")[2:]
  for depth in (2, 1):
    key = ".".join(rest[:depth])
    for i, layer in enumerate(LAYERS):
      if key in layer:
        return i
  raise AssertionError(f"{name}: in no layer of LAYERS")


def _src_targets(names, m, imported):
  """The `_src` modules an import of `m` (names `imported`) loads: `from pkg
  import module` imports pkg.module; `from module import f` the module."""
  return [t for t in [f"{m}.{i}" for i in imported if f"{m}.{i}" in names]
          or [m] if t in names]


def test_every_module_is_in_a_layer():
  for p in MODULES:
    if _name(p) != "jax_overlap._src":
      _layer(_name(p))


def test_each_module_imports_from_its_layer_or_below():
  names = {_name(p) for p in MODULES}
  bad = []
  for p in MODULES:
    name = _name(p)
    if name == "jax_overlap._src":
      continue
    for n, m, imported in _imports(p):
      for target in _src_targets(names, m, imported):
        if target != "jax_overlap._src" and _layer(target) > _layer(name):
          bad.append(f"{name} line {n}: {target}")
  assert not bad, bad


def _graph(paths, src: pathlib.Path = SRC) -> dict[str, set[str]]:
  """Module -> the modules it imports, function-level imports included."""
  names = {_name(p, src): p for p in paths}
  graph = {}
  for name, path in names.items():
    graph[name] = {t for _, m, imported in _imports(path, src=src)
                   for t in _src_targets(names, m, imported) if t != name}
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` (its modules in order, the first again at
  the end), or None."""
  state, stack = {}, []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for d in sorted(graph[n]):
      if state.get(d) == "open":
        return stack[stack.index(d):] + [d]
      if d not in state:
        found = visit(d)
        if found:
          return found
    stack.pop()
    state[n] = "done"
    return None

  for n in sorted(graph):
    if n not in state:
      found = visit(n)
      if found:
        return found
  return None


def test_no_import_cycle_between_src_modules():
  cycle = _cycle(_graph(MODULES))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
  package = tmp_path / "pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "a.py").write_text("from pkg import b\n")
  (package / "b.py").write_text(
      "def f():\n  from pkg.a import g  # noqa: PLC0415\n  return g\n")
  paths = sorted(package.rglob("*.py"))
  assert _cycle(_graph(paths, tmp_path)) == ["pkg.a", "pkg.b", "pkg.a"]
  (package / "b.py").write_text("def f():\n  return 1\n")
  assert _cycle(_graph(paths, tmp_path)) is None
