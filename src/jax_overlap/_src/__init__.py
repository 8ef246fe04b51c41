"""Private implementation of jax_overlap; import public names from `jax_overlap`."""

import os as _os

from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util

# Users see their own frames, not ours, in jax's filtered tracebacks.
_traceback_util.register_exclusion(_os.path.dirname(__file__))

# Nor are our frames taken for the user's where jax records "the user's line"
# (HLO metadata, errors, the overlap report's `where`). The demo's model is
# the user's code of the demo, so it is left out.
for _name in sorted(_os.listdir(_os.path.dirname(__file__))):
  _path = _os.path.join(_os.path.dirname(__file__), _name)
  if _name != "demo" and (_os.path.isdir(_path) or _name.endswith(".py")):
    _source_info_util.register_exclusion(
        _path + _os.sep if _os.path.isdir(_path) else _path)
