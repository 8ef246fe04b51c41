"""The one table of compiler workarounds (quirks.py)."""

import pathlib
import re
import warnings

import pytest

import jax_overlap
from jax_overlap._src import quirks

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("quirk", quirks.TABLE, ids=lambda q: q.name)
def test_each_row_names_its_versions_and_a_test_that_exists(quirk):
  assert quirk.platform in ("tpu", "gpu") and quirk.compiler in quirks.PACKAGES
  low, high = (quirks._version_key(v) for v in quirk.tested)
  assert low <= high
  path, _, name = quirk.test.partition("::")
  assert (ROOT / path).is_file(), quirk.test
  if name:
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), \
        quirk.test


def test_no_device_kind_is_matched_outside_the_table():
  src = ROOT / "src" / "jax_overlap" / "_src"
  found = [f"{p.relative_to(src)}:{n}"
           for p in src.rglob("*.py") if p.name != "quirks.py"
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"""in \w*KINDS\b|== ?["']TPU v\d""", line)]
  assert not found, found


def test_applies_by_platform_and_device_kind(monkeypatch):
  monkeypatch.setattr(quirks, "compiler_version", lambda c: None)
  assert quirks.applies("tpu-permute-forms", "tpu", "TPU v5")
  assert not quirks.applies("tpu-permute-forms", "tpu", "TPU v5 lite")
  assert not quirks.applies("tpu-permute-forms", "cuda", "TPU v5")
  assert quirks.applies("tpu-collective-forms", "tpu", None)
  assert quirks.applies("gpu-overlap-limit", "cuda")
  assert not quirks.applies("gpu-overlap-limit", "cpu")


def test_an_untested_compiler_version_is_applied_and_said_once(monkeypatch):
  monkeypatch.setattr(quirks, "compiler_version", lambda c: "0.0.99")
  monkeypatch.setattr(quirks, "_warned", set())
  with pytest.warns(jax_overlap.errors.CollectiveNotAsyncWarning,
                    match=r"libtpu 0.0.99 is outside the versions its "
                          r"workaround 'tpu-permute-forms' was measured on "
                          r"\(0.0.52 to 0.0.52\)"):
    assert quirks.applies("tpu-permute-forms", "tpu", "TPU v5")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert quirks.applies("tpu-permute-forms", "tpu", "TPU v5")
  monkeypatch.setattr(quirks, "compiler_version", lambda c: "0.0.52")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert quirks.applies("tpu-permute-scheduler", "tpu", "TPU v5")


def test_the_version_is_read_from_the_installed_package():
  quirks.compiler_version.cache_clear()
  try:
    import importlib.metadata as metadata
    want = metadata.version("libtpu")
  except Exception:  # noqa: BLE001 - not installed in this venv
    want = None
  assert quirks.compiler_version("libtpu") == want
