"""`_compat`'s feature flags read the running jax as the version table in
its comments says (jax-facts.md measured them), by features alone."""

import inspect

import jax
import pytest

from jax_overlap._src import _compat

_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])


def test_remat_rule_returns_residuals_from_0_12_on():
  assert _compat._REMAT_RULE_RETURNS_RESIDUALS == (_VERSION >= (0, 12, 0))


def test_no_flag_is_read_from_jax_source():
  assert "getsource" not in inspect.getsource(_compat)


@pytest.mark.parametrize("flag, since", [("USE_HIJAX", (0, 12, 0)),
                                         ("ASYNC_CUSTOM_CALLS", (0, 12, 0))])
def test_version_flags(flag, since):
  assert getattr(_compat, flag) == (_VERSION >= since)


def test_every_supported_jax_has_the_pallas_tpu_api_of_the_flash_kernel():
  # patterns/attention/flash_tpu.py; where a jax lacks it, attention runs on
  # XLA's operations with one warning (flash_tpu_test).
  assert _compat.pallas_tpu_missing() is None
