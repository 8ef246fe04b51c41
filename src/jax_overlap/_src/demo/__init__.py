"""The demo behind `make demo` / `jax-overlap demo`: FSDP training, shown."""
