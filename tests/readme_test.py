"""Every ```python block in README.md and docs/*.md runs as written.

The blocks of one file run in order in one fresh process (8 CPU devices,
from the repository root), each in a fresh namespace, except that a block
preceded by the comment `<!-- continues the block above -->` runs in the
namespace the block above left. A block that needs a newer jax says so in a
comment before it, `<!-- requires: jax>=0.12 -->`; elsewhere it is skipped,
with that reason. A block not meant to run (shell commands, output, TOML)
is fenced as ```sh, ```text or the like, never ```python; an unlabelled
fence is refused, so no Python hides in one.

A block that raises is reported with its file and line: it is compiled
under the Markdown file's name with its own line numbers, so the traceback
points into the Markdown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)```(.*)$")
_REQUIRES = re.compile(r"<!--\s*requires:\s*jax\s*>=\s*([\d.]+)\s*-->")
_CONTINUES = re.compile(r"<!--\s*continues the block above\s*-->")


@dataclasses.dataclass
class Block:
  path: str           # relative to the repository root
  line: int           # of the first line of code (the one after the fence)
  code: str
  requires: str | None = None   # a jax version, from the marker
  continues: bool = False

  @property
  def where(self) -> str:
    return f"{self.path}:{self.line}"


def code_blocks(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[Block]:
  """The ```python blocks of `path`, with their markers. Raises ValueError
  for a fence with no language (say what it holds: python, sh, text)."""
  lines = path.read_text().splitlines()
  blocks, i, after = [], 0, 0  # after: the line after the last block
  name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    info = m.group(2).strip()
    if not info:
      raise ValueError(f"{name}:{i + 1}: a ``` fence without a language; "
                       "write ```python for code that runs, ```sh or ```text "
                       "for what does not")
    end = next((j for j in range(i + 1, len(lines))
                if lines[j].strip() == "```"), None)
    if end is None:
      raise ValueError(f"{name}:{i + 1}: the code block is never closed")
    if info.split()[0] == "python":
      before = "\n".join(lines[max(after, i - 3):i])  # its markers
      requires = _REQUIRES.search(before)
      blocks.append(Block(name, i + 2, "\n".join(lines[i + 1:end]) + "\n",
                          requires.group(1) if requires else None,
                          bool(_CONTINUES.search(before))))
    i = after = end + 1
  return blocks


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", text))


# The runner, in the child process: one JSON line per block on stdout's last
# line; the blocks' own output goes to stdout before it.
_RUNNER = r"""
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
results, namespace = [], None
for b in blocks:
  if b["skip"]:
    results.append({"status": "skipped", "reason": b["skip"]})
    namespace = None
    continue
  if not b["continues"] or namespace is None:
    namespace = {"__name__": "__main__"}
  code = compile("\n" * (b["line"] - 1) + b["code"], b["path"], "exec")
  try:
    exec(code, namespace)
    results.append({"status": "ok"})
  except BaseException:
    results.append({"status": "error", "traceback": traceback.format_exc()})
    namespace = None
sys.stdout.flush()
print("\n" + json.dumps(results))
"""


def run_blocks(blocks: list[Block], cwd: pathlib.Path = ROOT,
               timeout: float = 600) -> list[dict]:
  """Runs `blocks` in order in one fresh Python process; a result per
  block: {'status': 'ok' | 'skipped' | 'error', ...}."""
  here = _version(jax.__version__)
  payload = [dict(dataclasses.asdict(b), skip=(
      f"needs jax>={b.requires} (this is {jax.__version__})"
      if b.requires and here < _version(b.requires) else None))
      for b in blocks]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8",
             MPLBACKEND="Agg")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  out = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(payload),
                       capture_output=True, text=True, timeout=timeout, cwd=cwd,
                       env=env)
  last = out.stdout.strip().splitlines()[-1:] or [""]
  try:
    return json.loads(last[0])
  except json.JSONDecodeError:
    raise AssertionError(f"the block runner died (exit {out.returncode}):\n"
                         f"{out.stderr[-3000:]}") from None


_BLOCKS: dict[pathlib.Path, list[Block]] = {}
_FENCE_ERRORS: list[str] = []
for _path in DOCS:
  try:
    _BLOCKS[_path] = code_blocks(_path)
  except ValueError as e:  # reported by a test, not at collection
    _BLOCKS[_path] = []
    _FENCE_ERRORS.append(str(e))
_CASES = [(path, k) for path, blocks in _BLOCKS.items()
          for k in range(len(blocks))]
_results: dict[pathlib.Path, list[dict]] = {}


def _results_of(path: pathlib.Path) -> list[dict]:
  if path not in _results:  # one process for all the blocks of a file
    _results[path] = run_blocks(_BLOCKS[path])
  return _results[path]


def test_every_fence_in_the_docs_names_its_language():
  assert not _FENCE_ERRORS


def test_the_docs_have_python_blocks():
  assert len(_CASES) >= 5
  assert {p.name for p, _ in _CASES} >= {"README.md", "fsdp.md",
                                        "overlap-report.md"}


@pytest.mark.parametrize("path, index", _CASES, ids=[
    _BLOCKS[p][k].where for p, k in _CASES])
def test_block_runs(path, index):
  block = _BLOCKS[path][index]
  result = _results_of(path)[index]
  if result["status"] == "skipped":
    pytest.skip(f"{block.where}: {result['reason']}")
  assert result["status"] == "ok", (
      f"{block.where}: the block raised\n{result['traceback']}")


def test_a_block_that_raises_is_reported_at_its_file_and_line(tmp_path):
  doc = tmp_path / "guide.md"
  doc.write_text("# Guide\n\n```python\nx = 1\n```\n\n"
                 "<!-- continues the block above -->\n```python\ny = x + 1\n"
                 "raise ValueError(f'bad {y}')\n```\n\n"
                 "<!-- requires: jax>=99 -->\n```python\nimport nothing\n```\n"
                 "\n```sh\nnot python\n```\n")
  blocks = code_blocks(doc, root=tmp_path)
  assert [(b.where, b.continues, b.requires) for b in blocks] == [
      ("guide.md:4", False, None), ("guide.md:9", True, None),
      ("guide.md:15", False, "99")]
  results = run_blocks(blocks, cwd=tmp_path)
  assert [r["status"] for r in results] == ["ok", "error", "skipped"]
  assert 'File "guide.md", line 10' in results[1]["traceback"]
  assert "ValueError: bad 2" in results[1]["traceback"]
  assert "needs jax>=99" in results[2]["reason"]


def test_a_fence_without_a_language_is_refused(tmp_path):
  doc = tmp_path / "bare.md"
  doc.write_text("text\n```\nprint(1)\n```\n")
  with pytest.raises(ValueError, match=r"bare.md:2: a ``` fence without a language"):
    code_blocks(doc, root=tmp_path)
