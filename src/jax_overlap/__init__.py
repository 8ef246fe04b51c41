"""jax-overlap: exact control over when communication and computation run."""

from jax_overlap._src.collectives import all_gather_start as all_gather_start
from jax_overlap._src.collectives import all_to_all_start as all_to_all_start
from jax_overlap._src.collectives import ppermute_start as ppermute_start
from jax_overlap._src.collectives import psum_scatter_start as psum_scatter_start
from jax_overlap._src.collectives import psum_start as psum_start
from jax_overlap._src.future import Future as Future
from jax_overlap._src.program_order import program_order as program_order

__all__ = [
    "Future",
    "all_gather_start",
    "all_to_all_start",
    "ppermute_start",
    "program_order",
    "psum_scatter_start",
    "psum_start",
]
__version__ = "0.1.0"
