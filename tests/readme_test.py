"""The README's example runs as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
  code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                                                    "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1] == "(32, 4)"
