"""examples/moe_train.py trains: a few steps, the loss falls, drops are
counted, the experts stay sharded."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "moe_train.py"


@pytest.mark.slow
@pytest.mark.subprocess
def test_moe_train_example_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "10",
                        "--blocks", "1"], capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out.stdout)]
  assert len(losses) >= 2 and losses[-1] < losses[0], out.stdout
  # 8 devices x 64 tokens x 2 choices, one block; capacity 20 of an average 16.
  dropped = [int(v) for v in re.findall(r"dropped +(\d+) of 1024 ", out.stdout)]
  assert len(dropped) == len(losses) and all(0 <= d < 1024 for d in dropped), out.stdout
  assert "the experts stayed sharded: P(None, 'e')" in out.stdout
