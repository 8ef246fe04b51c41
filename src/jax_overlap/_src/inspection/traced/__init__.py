"""The traced program: its jaxpr read as written, before any compile."""
