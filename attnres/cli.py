"""The `attnres` command: one subcommand per module of `attnres.commands`."""

from __future__ import annotations

import argparse
import importlib

# each module defines `register(subparsers)`, adding its subcommand with a `func(args) -> int` default
COMMANDS = ("compare", "train", "generate", "convert", "estimate", "demo", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres",
        description="Attention Residuals: the residual sum of a Transformer replaced by a softmax attention over depth.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attnres.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args) or 0


if __name__ == "__main__":
    raise SystemExit(main())
