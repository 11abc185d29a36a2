"""`lightning-mw`: the one command-line entry point.

Each feature module contributes its subcommands through `add_cli(subparsers)`;
modules are imported only to register their parsers, so their heavy imports
must live inside the command functions.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules that contribute subcommands. Missing ones (a feature not built yet, an
# optional dependency not installed) are skipped with a debug log.
COMMAND_MODULES = (
    "lightning_middleware.example",
    "lightning_middleware.inspect",
    "lightning_middleware.controller",
    "lightning_middleware.export",
    "trainer_backend.daemon",
    "lightning_middleware.gateway",
    "lightning_middleware.serving",
    "lightning_middleware.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-mw", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            logging.getLogger(__name__).debug("commands of %s unavailable: %s", name, exc)
            continue
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
