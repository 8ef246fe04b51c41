"""The `jax-overlap` command line."""
