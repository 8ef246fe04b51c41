"""jax-overlap: exact control over when communication and computation run."""

from jax_overlap._src.program_order import program_order as program_order

__all__ = ["program_order"]
__version__ = "0.1.0"
