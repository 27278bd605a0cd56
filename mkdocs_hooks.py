"""MkDocs hook: the CLI reference page, generated from ``ortserve``'s own parser."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- ortserve-cli-reference -->"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from ortserve_server._cli import _build_parser

    parser = _build_parser()
    parts = ["```text", parser.format_help().rstrip(), "```"]
    for name, command in _commands(parser).items():
        parts += ["", f"## `ortserve {name}`", "", "```text", command.format_help().rstrip(), "```"]
    return markdown.replace(MARKER, "\n".join(parts))
