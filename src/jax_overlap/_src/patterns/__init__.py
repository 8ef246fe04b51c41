"""Overlap patterns built on the public API: collective matmul, FSDP prefetch."""
