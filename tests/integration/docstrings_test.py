"""Every docstring example in src/jax_overlap runs, one test a module.

The modules are found by their text (a line starting `>>>`), so a module gains
its test by gaining an example; each is imported and run when its test runs.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(SRC).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_with_examples() -> list[str]:
  return sorted(
      _module_name(path) for path in (SRC / "jax_overlap").rglob("*.py")
      if any(line.lstrip().startswith(">>>")
             for line in path.read_text().splitlines()))


MODULES = _modules_with_examples()


def examples(name: str) -> list[doctest.DocTest]:
  """The docstring tests of module `name` (its own objects, not its imports)."""
  module = importlib.import_module(name)
  return [t for t in doctest.DocTestFinder().find(module) if t.examples]


def test_the_modules_with_examples_are_found():
  assert len(MODULES) >= 20, MODULES
  assert {"jax_overlap.errors", "jax_overlap._src.collectives.api",
          "jax_overlap._src.patterns.fsdp.scan"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  tests = examples(name)
  assert tests, f"{name} has a line starting >>> that doctest does not find"
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  for test in tests:
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.attempted > 0 and result.failed == 0, result
