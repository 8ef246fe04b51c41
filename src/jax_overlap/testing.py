"""Overlap assertions for your own tests, on the real compilers, with no
accelerator.

`assert_overlapped(fn, *args, target="tpu-v5e", max_exposed_fraction=0.1)`
compiles `fn` ahead of time with the real TPU or GPU compiler for a
described topology (libtpu, or the CUDA plugin with one of XLA's GPU target
configs, shipped here), reads the scheduled program into an
`OverlapReport`, and fails with the report's rows when a collective is
exposed for longer than allowed. `target_mesh` gives a mesh over a target's
devices, to build a function (and its arguments) for it. Targets:
`TARGETS`; a missing compiler raises `CompilerNotFoundError`, saying what
to install. docs/overlap-report.md, "In your tests", has a pytest example.

Example:
  >>> from jax_overlap import testing
  >>> sorted(testing.TARGETS)
  ['gpu-a100', 'gpu-h100', 'tpu-v5e', 'tpu-v5p']
"""

from jax_overlap._src.testing.assertion import assert_overlapped as assert_overlapped
from jax_overlap._src.testing.assertion import target_mesh as target_mesh
from jax_overlap._src.testing.targets import CompilerNotFoundError as CompilerNotFoundError
from jax_overlap._src.testing.targets import TARGETS as TARGETS

__all__ = ["CompilerNotFoundError", "TARGETS", "assert_overlapped", "target_mesh"]
