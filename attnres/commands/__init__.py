"""Subcommands of the `attnres` CLI, one module each."""
