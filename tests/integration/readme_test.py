"""Every ```python block in README.md and docs/*.md runs as written.

The blocks of one file run in order in one fresh process (8 CPU devices),
each in a fresh namespace, except that a block
preceded by the comment `<!-- continues the block above -->` runs in the
namespace the block above left. A block that needs a newer jax says so in a
comment before it, `<!-- requires: jax>=0.12 -->`; elsewhere it is skipped,
with that reason. A block not meant to run (shell commands, output, TOML)
is fenced as ```sh, ```text or the like, never ```python; an unlabelled
fence is refused, so no Python hides in one.

The process runs in a fresh temporary directory, never in the repository:
what a block writes (a trace, a picture) lands there and is removed with
it. The directory holds a copy of tests/fixtures/, so a block reads a
fixture by its path from the repository root, as a reader running it from
a checkout would.

A block that raises is reported with its file and line: it is compiled
under the Markdown file's name with its own line numbers, so the traceback
points into the Markdown.

The other tests here check the pages themselves: the README is a front page
(at most 250 lines, the two commands first, every public function named),
docs/index.md lists every page, and every relative link in README.md and
docs/*.md points to a file (and a heading) that exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


#: What the blocks may read by a path from the repository root, copied into
#: their temporary directory.
FIXTURES = pathlib.Path("tests") / "fixtures"


def run_blocks(blocks: list[Block], cwd: pathlib.Path | None = None,
               timeout: float = 600) -> list[dict]:
  """Runs `blocks` in order in one fresh Python process, in `cwd` or else in
  a fresh temporary directory holding a copy of FIXTURES; a result per
  block: {'status': 'ok' | 'skipped' | 'error', ...}."""
  if cwd is None:
    with tempfile.TemporaryDirectory(prefix="doc-blocks-") as tmp:
      shutil.copytree(ROOT / FIXTURES, pathlib.Path(tmp) / FIXTURES)
      return run_blocks(blocks, pathlib.Path(tmp), timeout)
  here = _version(jax.__version__)
  payload = [dict(dataclasses.asdict(b), skip=(
      f"needs jax>={b.requires} (this is {jax.__version__})"
      if b.requires and here < _version(b.requires) else None))
      for b in blocks]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS"),  # conftest's
                                              "--xla_force_host_platform_device_count=8"])),
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
  # README.md held 7 blocks before its sections moved into docs/; each still
  # runs, on the page it moved to.
  assert len(_CASES) >= 16
  assert {p.name for p, _ in _CASES} >= {
      "README.md", "fsdp.md", "overlap-report.md", "futures.md",
      "fsdp-quickstart.md", "collective-matmul.md", "moe.md"}


#: What a block that uses several devices writes to have them on any machine.
DEVICE_SETUP = 'jax.config.update("jax_num_cpu_devices", 8)'
_USES_DEVICES = re.compile(r"make_mesh\(|jax\.devices\(\)|\bMesh\(")


def blocks_without_device_setup(blocks: list[Block]) -> list[str]:
  """Where a block builds a mesh or lists the devices without setting up 8
  CPU devices itself or in a block it continues (the test runner gives its
  process 8, a reader's machine may have one)."""
  missing, set_up = [], False
  for b in blocks:
    set_up = (set_up and b.continues) or DEVICE_SETUP in b.code
    if _USES_DEVICES.search(b.code) and not set_up:
      missing.append(b.where)
  return missing


def test_blocks_that_use_devices_set_them_up():
  # A reader copies a block into a fresh Python on a laptop: it must run
  # there as here (issue 43: pipeline.md's and attention.md's did not).
  missing = [w for blocks in _BLOCKS.values()
             for w in blocks_without_device_setup(blocks)]
  assert not missing, (f"these blocks use devices without {DEVICE_SETUP} "
                       f"(after their imports): {missing}")
  probe = [Block("a.md", 1, "mesh = jax.make_mesh((2,), ('x',))\n"),
           Block("a.md", 5, f"{DEVICE_SETUP}\nmesh = jax.make_mesh((2,), ('x',))\n"),
           Block("a.md", 9, "m = jax.make_mesh((2,), ('x',))\n", continues=True)]
  assert blocks_without_device_setup(probe) == ["a.md:1"]


@pytest.mark.subprocess
def test_blocks_run_in_a_temporary_directory_not_the_repository():
  name = "written-by-a-doc-block.txt"
  blocks = [Block("probe.md", 1,
                  "import os, pathlib\n"
                  f"pathlib.Path({name!r}).write_text('x')\n"
                  f"assert pathlib.Path({str(FIXTURES)!r}).is_dir()\n"
                  f"assert os.path.realpath(os.getcwd()) != {str(ROOT)!r}\n")]
  assert run_blocks(blocks) == [{"status": "ok"}]
  assert not (ROOT / name).exists()


# --- the pages themselves ------------------------------------------------------

README = ROOT / "README.md"
README_MAX_LINES = 250


def _outside_fences(text: str) -> str:
  """`text` with every fenced block blanked (its lines kept, empty)."""
  out, fenced = [], False
  for line in text.splitlines():
    if _FENCE.match(line):
      fenced = not fenced
      out.append("")
    else:
      out.append("" if fenced else line)
  return "\n".join(out)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lowercase, punctuation dropped (but `-`
  and `_`), spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """The anchors of `path`'s headings (a repeated one gets -1, -2, ...)."""
  seen: dict[str, int] = {}
  for line in _outside_fences(path.read_text()).splitlines():
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      slug = _slug(m.group(1))
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      if n:
        slug = f"{slug}-{n}"
      seen.setdefault(slug, 1)
  return set(seen)


_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(path: pathlib.Path) -> list[str]:
  """The targets of `path`'s Markdown links that are not URLs, outside code
  fences and inline code."""
  text = re.sub(r"`[^`\n]*`", "", _outside_fences(path.read_text()))
  return [t for t in _LINK.findall(text)
          if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: pathlib.Path) -> list[str]:
  """Each relative link of `path` whose file, or whose heading, is missing."""
  broken = []
  for target in relative_links(path):
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    if not dest.exists():
      broken.append(f"{target}: no file {dest}")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      broken.append(f"{target}: no heading #{anchor} in {dest.name}")
  return broken


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_points_to_what_exists(path):
  assert not broken_links(path)


def test_a_broken_link_is_found(tmp_path):
  (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Twice\n## Twice\n")
  doc = tmp_path / "page.md"
  doc.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) "
                 "[ok](there.md#twice-1) [ok](#local) [url](https://x.y/z)\n"
                 "# Local\n[gone](missing.md) [no heading](there.md#nowhere)\n"
                 "`[in code](nothing.md)`\n```text\n[fenced](nothing.md)\n```\n")
  assert broken_links(doc) == [
      f"missing.md: no file {tmp_path / 'missing.md'}",
      "there.md#nowhere: no heading #nowhere in there.md"]


def test_the_readme_is_a_front_page():
  text = README.read_text()
  lines = text.splitlines()
  assert len(lines) <= README_MAX_LINES, (
      f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move "
      "the detail into docs/")
  # It opens with the two commands that set everything up, the main job first.
  first = re.search(r"```sh\n(.*?)```", text, re.S)
  assert first and text.index(first.group(0)) < text.index("\n## ")
  commands = [ln.split("#")[0].strip() for ln in first.group(1).splitlines()]
  assert commands[:2] == ["make demo", "make test"]
  # It says how long `make test` takes (or, until measured, a marked TODO).
  assert re.search(r"`make test`[^.]{0,80} about \d+ minutes"
                   r"|^TODO: make test: time to be measured", text, re.M)
  # Supported versions, and where to read more.
  for jax_version, python in [("0.10.2", "3.11"), ("0.11.0", "3.12"),
                              ("0.12.0.1", "3.12")]:
    assert re.search(rf"\| {re.escape(jax_version)} \| >= {python} \|", text)
  assert "(docs/index.md)" in text


def test_the_readme_names_every_public_function_and_the_docs_every_name():
  import jax_overlap  # noqa: PLC0415
  readme = README.read_text()
  everything = readme + "".join(p.read_text() for p in DOCS)
  unnamed_in_readme = [
      n for n in jax_overlap.__all__
      if not isinstance(getattr(jax_overlap, n), type)
      and not re.search(rf"`(jax_overlap\.)?{n}[`(]", readme)]
  assert not unnamed_in_readme
  unnamed = [n for n in jax_overlap.__all__
             if not re.search(rf"\b{n}\b", everything)]
  assert not unnamed


def test_the_index_lists_every_page():
  index = ROOT / "docs" / "index.md"
  listed = {t.partition("#")[0] for t in relative_links(index)}
  pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
  assert pages <= listed, f"not in docs/index.md: {sorted(pages - listed)}"
  lines = [ln for ln in index.read_text().splitlines() if ln.startswith("- [")]
  assert len(lines) == len(pages), "one line a page"


@pytest.mark.parametrize("path, index", _CASES, ids=[
    _BLOCKS[p][k].where for p, k in _CASES])
@pytest.mark.subprocess
def test_block_runs(path, index):
  block = _BLOCKS[path][index]
  result = _results_of(path)[index]
  if result["status"] == "skipped":
    pytest.skip(f"{block.where}: {result['reason']}")
  assert result["status"] == "ok", (
      f"{block.where}: the block raised\n{result['traceback']}")


@pytest.mark.subprocess
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
