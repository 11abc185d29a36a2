"""`lightning-mw`: the one command-line entry point.

Subcommands are registered through the `lightning_middleware.commands` entry-point group
(pyproject.toml): each entry is an `add_cli(subparsers)` function. The core therefore never
names the trainer's package, and a package installed beside it can add its own commands.
Registering must stay cheap: heavy imports live inside the command functions. When the command
line names an entry point's command, that entry point alone is loaded: a rollout worker's pod
(`lightning-mw rollouts worker`) then never imports the trainer's settings to build a parser it
does not use (a tenth of its start's CPU on a 2-core AVX2 EPYC; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from lightning_middleware.errors import UsageError

ENTRY_POINT_GROUP = "lightning_middleware.commands"
log = logging.getLogger(__name__)


def build_parser(commands: Iterable[EntryPoint] | None = None, argv: list[str] | None = None
                 ) -> argparse.ArgumentParser:
    """The parser of every command, or, where `argv` names an entry point's command, of that one."""
    parser = argparse.ArgumentParser(prog="lightning-mw", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    eps = list(entry_points(group=ENTRY_POINT_GROUP) if commands is None else commands)
    named = _named_command(argv or [])
    # Another entry point may register more names than its own (`serve` adds `vllm-env`): those, a
    # typo and `--help` load them all, so every choice is there to parse or to list.
    eps = [ep for ep in eps if ep.name == named] or eps
    for ep in eps:
        try:
            add_cli = ep.load()
        except ImportError as exc:
            _add_unavailable(sub, ep, exc)
            continue
        add_cli(sub)
    return parser


def _named_command(argv: list[str]) -> str | None:
    """The command the arguments name, if nothing but `-v` comes before it."""
    for arg in argv:
        if arg not in ("-v", "--verbose"):
            return None if arg.startswith("-") else arg
    return None


def _add_unavailable(sub: Any, ep: EntryPoint, exc: ImportError) -> None:
    """A command whose module cannot be imported stays listed, and running it says why in one line.

    A missing third-party module is an optional dependency not installed (expected: the core runs
    without the trainer's packages). Anything else (a name missing from the command's own package)
    is a bug in that package, so it is also logged as a warning: a command must never vanish silently.
    """
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    own = ep.value.split(":")[0].split(".")[0]
    if missing and missing.split(".")[0] != own:
        reason = f"needs the package {missing.split('.')[0]!r}, which is not installed"
        log.debug("command %s unavailable: %s", ep.name, exc)
    else:
        reason = f"its module failed to import ({type(exc).__name__}: {exc})"
        log.warning("command %s: %s", ep.name, reason, exc_info=log.isEnabledFor(logging.DEBUG))

    def unavailable(_args: argparse.Namespace) -> int:
        raise UsageError(f"unavailable: {reason}")

    # No option prefix: every argument is taken as it is, so the reason is printed whatever was typed.
    p = sub.add_parser(ep.name, help=f"(unavailable: {reason})", add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=unavailable)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv=argv)
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
