"""examples/fsdp_train.py trains: a few steps, the loss falls, weights stay sharded."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "fsdp_train.py"


@pytest.mark.subprocess
def test_fsdp_train_example_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "20",
                        "--layers", "2"], capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out.stdout)]
  assert len(losses) >= 2 and losses[-1] < losses[0], out.stdout
  assert "the weights stayed sharded: P(None, 'd')" in out.stdout
