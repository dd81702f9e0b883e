"""The ``framework`` command: parses arguments, then hands over to the part that does the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _cmd_plugins(args: argparse.Namespace) -> int:
    from framework.registry import REGISTRIES

    for registry in REGISTRIES:
        print(f"{registry.kind}s (entry-point group {registry.group}):")
        for entry in registry.entries():
            print(f"  {entry.name:<12} {entry.target:<60} [{entry.source}]")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from framework.config import ServerArgs
    from framework.server.serve import run_server

    return run_server(ServerArgs.from_cli_args(args))


def _cmd_bench_transport(args: argparse.Namespace) -> int:
    from framework.bench.transport import run_from_cli

    return run_from_cli(args)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, one sub-command per job."""
    parser = argparse.ArgumentParser(
        prog="framework", description="An asyncio-first LLM serving runtime."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible server",
        description="Start the HTTP server, the Scheduler and the Detokenizer.",
    )
    from framework.config import ServerArgs

    ServerArgs.add_cli_args(serve)
    serve.set_defaults(handler=_cmd_serve)

    plugins = sub.add_parser("plugins", help="list registered transports, codecs and "
                             "attention backends")
    plugins.set_defaults(handler=_cmd_plugins)

    bench = sub.add_parser("bench", help="run a benchmark harness")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True
    transport = bench_sub.add_parser("transport", help="compare transport × codec pairs")
    from framework.bench.transport import add_cli_args as add_transport_args

    add_transport_args(transport)
    transport.set_defaults(handler=_cmd_bench_transport)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        # User errors end in one line, not a traceback.
        print(f"framework: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
