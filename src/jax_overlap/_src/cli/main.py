"""`jax-overlap COMMAND ...`: one module per subcommand.

A subcommand module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int` (the exit status); list it in `SUBCOMMANDS` to add it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = (
    "jax_overlap._src.cli.demo_command",
    "jax_overlap._src.cli.inspect_command",
    "jax_overlap._src.cli.profile_command",
)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jax-overlap",
      description="Exact control over when communication and computation "
                  "run in JAX, and a look at what overlapped.")
  commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                   required=True)
  for module_name in SUBCOMMANDS:
    module = importlib.import_module(module_name)
    sub = commands.add_parser(module.NAME, help=module.HELP,
                              description=module.__doc__)
    module.add_arguments(sub)
    sub.set_defaults(run=module.run)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the command line on `argv` (default: `sys.argv[1:]`); returns the
  exit status: 0 on success, 2 for bad input."""
  args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
