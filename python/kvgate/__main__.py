"""The ``kvgate`` command line: ``kvgate sim``, ``kvgate serve``, ``kvgate demo``, ``kvgate check-config``.

Each subcommand lives in its own module and is imported only when chosen, so ``kvgate --help``
stays fast and importing :mod:`kvgate` has no side effects.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Each module exposes ``add_arguments(parser)`` and
# ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("kvgate.sim.cli", "run the engine simulator (OpenAI-compatible fake engine)"),
    "serve": ("kvgate.cli_serve", "run the admission gateway"),
    "demo": (
        "kvgate.demo",
        "the same traffic straight to the simulator and through kvgate, side by side",
    ),
    "check-config": ("kvgate.cli_check", "validate a configuration file without starting"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    chosen_module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(chosen_module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
