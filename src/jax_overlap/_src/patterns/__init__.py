"""Overlap patterns built on the public API: FSDP prefetch, collective matmul."""
