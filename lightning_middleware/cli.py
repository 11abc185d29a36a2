"""`lightning-mw`: the one command-line entry point.

Subcommands are registered through the `lightning_middleware.commands` entry-point group
(pyproject.toml): each entry is an `add_cli(subparsers)` function. The core therefore never
names the trainer's package, and a package installed beside it can add its own commands.
Registering must stay cheap: heavy imports live inside the command functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from lightning_middleware.errors import UsageError

ENTRY_POINT_GROUP = "lightning_middleware.commands"
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-mw", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            add_cli = ep.load()
        except ImportError as exc:  # an optional dependency not installed: that command is absent
            log.debug("command %s unavailable: %s", ep.name, exc)
            continue
        add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return _dispatch(parser, parser.parse_args(argv))


def run_command(name: str, add_cli: Callable[[Any], None], argv: list[str] | None = None) -> int:
    """`python -m <a command's module> ...` = `lightning-mw NAME ...`, without the installed
    entry points (a checkout not yet reinstalled): the same parsing, logging and errors."""
    parser = argparse.ArgumentParser(prog="lightning-mw")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_cli(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return _dispatch(parser, parser.parse_args([name, *(sys.argv[1:] if argv is None else argv)]))


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:  # a bad URL, path, file or name: one line that names it, no traceback
        print(f"lightning-mw {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
