"""The `attnres` command: one subcommand per module of `attnres.commands`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# each module defines `register(subparsers)`, adding its subcommand with a `func(args) -> int` default
COMMANDS = ("compare", "train", "generate", "fetch", "convert", "estimate", "demo", "bench")
DEBUG_ENV = "ATTNRES_DEBUG"  # set (or pass --debug) to see the traceback of an expected mistake
DEBUG_HELP = f"show the traceback of an error instead of its one-line message (or set {DEBUG_ENV}=1)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres",
        description="Attention Residuals: the residual sum of a Transformer replaced by a softmax attention over depth.",
        epilog="`attnres COMMAND --help` says what a command does, with examples.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attnres.commands.{name}").register(sub)
    for command in sub.choices.values():  # `attnres convert ... --debug` too; set only when given
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as error:  # an expected mistake: a refused family, a bad setting, a missing folder
        if args.debug or os.environ.get(DEBUG_ENV):
            raise
        message = " ".join(str(error).split())
        print(f"attnres {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
