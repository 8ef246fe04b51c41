"""Overlap patterns built on the public API: FSDP prefetch, collective matmul, expert parallelism (MoE)."""

import os as _os

from jax._src import source_info_util as _source_info_util

# The collectives a pattern starts are reported (errors, overlap reports) at
# the user's call of the pattern, not at a line inside it.
_source_info_util.register_exclusion(_os.path.dirname(__file__) + _os.sep)
