"""Every exception and warning jax-overlap raises or warns with, as `jax.errors`.

Example:
  >>> import warnings
  >>> import jax_overlap
  >>> from jax_overlap import errors
  >>> errors.FutureNotFinishedError is jax_overlap.FutureNotFinishedError
  True
  >>> # Silence one kind of warning, here the one for a collective that a
  >>> # compiler could not keep in flight:
  >>> warnings.filterwarnings("ignore", category=errors.CollectiveNotAsyncWarning)
"""

from jax_overlap._src.collectives.future import FutureNotFinishedWarning as FutureNotFinishedWarning
from jax_overlap._src.collectives.misuse import FutureNotFinishedError as FutureNotFinishedError
from jax_overlap._src.collectives.not_async import CollectiveNotAsyncWarning as CollectiveNotAsyncWarning
from jax_overlap._src.inspection.errors import HardwareProfileError as HardwareProfileError
from jax_overlap._src.inspection.errors import HloParseError as HloParseError
from jax_overlap._src.inspection.measured.xplane import ProfileReadError as ProfileReadError
from jax_overlap._src.xla.compiled_order import OrderNotKeptWarning as OrderNotKeptWarning
from jax_overlap._src.patterns.fsdp.argument_order import LayerArgumentOrderWarning as LayerArgumentOrderWarning
from jax_overlap._src.testing.targets import CompilerNotFoundError as CompilerNotFoundError

__all__ = [
    "CollectiveNotAsyncWarning",
    "CompilerNotFoundError",
    "FutureNotFinishedError",
    "FutureNotFinishedWarning",
    "HardwareProfileError",
    "HloParseError",
    "LayerArgumentOrderWarning",
    "OrderNotKeptWarning",
    "ProfileReadError",
]
