"""The command line, ``python -m ourobatch COMMAND``: ``generate`` (JSONL prompts in, JSONL completions out;
generate.py, its input and output in jsonl.py) and ``serve`` (the HTTP server, ourobatch.server.cli). Both
take the engine's flags from ourobatch.engine_args. ``main(argv)`` returns the exit code (0 ok, 2 bad input
or a library error) so tests can call it.
"""

from __future__ import annotations

import argparse
import sys

from ourobatch._logging import console_logging

from . import generate

EXIT_USAGE = generate.EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ourobatch",
                                     description="ourobatch: rollout generation for looped language models (Ouro).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (python -m ourobatch serve --help)")
    generate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the HTTP server has its own options (ourobatch.server.cli)
        return _serve(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with console_logging(args.log_level):  # the entry point is the host: the library configures nothing
        return generate.run(args)


def _serve(argv: list[str]) -> int:
    from ourobatch._extras import MissingExtraError

    try:
        from ourobatch.server.cli import main as serve

        return serve(argv)
    except MissingExtraError as exc:  # one line naming the pip install, not a traceback
        print(f"ourobatch serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["build_parser", "main"]
