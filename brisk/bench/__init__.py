"""`brisk bench`: benchmark clients for running servers. `brisk bench serve` load-tests any OpenAI-compatible one.

Only the standard library is imported here, so that building the `brisk` command line costs nothing; the
benchmark itself needs the `[bench]` extra (httpx, matplotlib).
"""

from __future__ import annotations

import argparse


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    from brisk.bench import serve

    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve.add_arguments(
        sub.add_parser(
            "serve", help="load-test an OpenAI-compatible server", description=serve.__doc__.split("\n\n")[0]
        )
    )


def run(args: argparse.Namespace, command: str) -> int:
    from brisk.bench import serve

    return serve.run(args, command)
