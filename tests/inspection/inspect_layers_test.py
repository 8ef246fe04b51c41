"""The inspector's stages import only the stages before them, and no two of its
modules import each other (src/jax_overlap/_src/inspection/README.md)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2] / "src" / "jax_overlap" / "_src" / "inspection"
PACKAGE = "jax_overlap._src.inspection"
# A stage may import its own stage and those with a lower rank.
RANK = {"errors": 0, "reading": 1, "schedule": 2, "model": 3, "traced": 4,
        "report": 5, "measured": 6, "api": 7}


def _modules():
  for path in sorted(ROOT.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if parts:
      yield ".".join(parts), path


def _imports(path):
  """(module imported, at module level?) for each inspection import in path."""
  known = set(MODULES)
  tree = ast.parse(path.read_text())
  top = set(map(id, tree.body))
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
      rest = node.module[len(PACKAGE):].lstrip(".")
      names = [f"{rest}.{a.name}".lstrip(".") for a in node.names]
      for name in names:
        # `from pkg import module` names a module; `from pkg.module import X` a name.
        yield (name if name in known else rest), id(node) in top


MODULES = dict(_modules())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_earlier_stages(module):
  stage = RANK[module.split(".")[0]]
  for imported, _ in _imports(MODULES[module]):
    assert RANK[imported.split(".")[0]] <= stage, (module, imported)


def test_no_module_level_cycle():
  graph = {m: {i for i, at_top in _imports(p) if at_top and i in MODULES and i != m}
           for m, p in MODULES.items()}
  seen, on_path = set(), []

  def visit(m):
    assert m not in on_path, " -> ".join(on_path[on_path.index(m):] + [m])
    if m in seen:
      return
    on_path.append(m)
    for n in graph[m]:
      visit(n)
    on_path.pop()
    seen.add(m)

  for m in graph:
    visit(m)


def test_report_and_analysis_do_not_import_each_other():
  lazy_or_not = {m: {i for i, _ in _imports(p)} for m, p in MODULES.items()}
  assert "report.overlap_report" not in lazy_or_not["report.analysis"]
  assert "report.analysis" in lazy_or_not["report.overlap_report"]
