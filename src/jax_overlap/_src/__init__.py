"""Private implementation of jax_overlap; import public names from `jax_overlap`."""

import os as _os

from jax._src import traceback_util as _traceback_util

# Users see their own frames, not ours, in jax's filtered tracebacks.
_traceback_util.register_exclusion(_os.path.dirname(__file__))
