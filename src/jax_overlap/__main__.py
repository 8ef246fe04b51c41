"""`python -m jax_overlap COMMAND ...`, the same as the `jax-overlap` command."""

import sys

from jax_overlap._src.cli.main import main

sys.exit(main())
