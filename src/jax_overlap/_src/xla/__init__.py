"""What XLA gets: the lowering of ordered blocks (`ordered_blocks.py`) and of
futures (`futures.py`, `all_to_all_slots.py`), the rewrites of a lowered module
(`form_rewrites.py`), the compile options (`compile_options.py`), the GPU ties
(`gpu_ties.py`), whether the compiled program keeps the order
(`compiled_order.py`) and the one hook around jax's compile (`compile_hook.py`).
Above the trace-level halves (`ordering/`, `collectives/`), below the patterns
(tests/integration/layering_test.py)."""
