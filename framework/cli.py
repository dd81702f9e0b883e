"""The ``framework`` command: parses arguments, then hands over to the part that does the work."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _cmd_plugins(args: argparse.Namespace) -> int:
    from framework.models import MODEL_ARCHITECTURES
    from framework.optional import OPTIONAL_PARTS
    from framework.registry import REGISTRIES

    registries = (*REGISTRIES, MODEL_ARCHITECTURES)
    entries = [(registry, registry.entries()) for registry in registries]
    width = max(len(entry.name) for _, listed in entries for entry in listed)
    for registry, listed in entries:
        print(f"{registry.plural} (entry-point group {registry.group}):")
        for entry in listed:
            print(f"  {entry.name:<{width}} {entry.target:<60} [{entry.source}]")
    missing = [part for part in OPTIONAL_PARTS if not part.installed()]
    if missing:
        print("optional, not installed:")
        for part in missing:
            print(f"  {part.name:<{width}} {part.kind:<60} [not installed: {part.install}]")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from framework.config import ServerArgs
    from framework.server.serve import run_server

    return run_server(ServerArgs.from_cli_args(args))


def _cmd_router(args: argparse.Namespace) -> int:
    from framework.router.args import RouterArgs
    from framework.router.main import run

    return run(RouterArgs.from_cli_args(args))


# ``framework bench NAME``: the module holding its ``add_cli_args`` and ``run_from_cli``,
# and its help line (in the order the help lists them).
_BENCHMARKS: dict[str, tuple[str, str]] = {
    "transport": ("framework.bench.transport", "compare transport × codec pairs"),
    "prefix-cache": ("framework.bench.prefix_cache",
                     "time to first token and throughput, radix cache on vs off"),
    "offline": ("framework.bench.offline",
                "output tokens/s: the Engine vs transformers generate, and a ceiling"),
    "latency": ("framework.bench.latency",
                "one stream: ms per output token, split into forward, Scheduler and output path"),
    "serving": ("framework.bench.serving",
                "load an OpenAI-compatible server with streaming requests"),
    "speculative": ("framework.bench.speculative",
                    "output tokens/s with speculative decoding (ngram) vs without"),
    "quantized": ("framework.bench.quantized",
                  "output tokens/s and weight bytes of int8 and GPTQ int4 checkpoints vs "
                  "float32"),
    "structured": ("framework.bench.structured",
                   "output tokens/s with JSON-schema constraints vs without"),
    "soak": ("framework.bench.soak",
             "minutes of mixed traffic: flat memory, no error, no leaked slot"),
}


def _formatter(prog: str) -> argparse.HelpFormatter:
    # A fixed width keeps --help (and the generated reference) the same on every terminal.
    return argparse.HelpFormatter(prog, width=100, max_help_position=32)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, one sub-command per job."""
    parser = argparse.ArgumentParser(
        prog="framework", description="An asyncio-first LLM serving runtime.",
        formatter_class=_formatter,
    )
    from framework import __version__

    parser.add_argument("--version", action="version", version=f"framework {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_subparser)
    sub.required = True

    serve = sub.add_parser(
        "serve", help="start the OpenAI-compatible server",
        description="Start the HTTP server, the Scheduler and the Detokenizer.",
    )
    from framework.config import ServerArgs

    ServerArgs.add_cli_args(serve)
    serve.set_defaults(handler=_cmd_serve)

    router = sub.add_parser(
        "router", help="route requests across several OpenAI-compatible servers",
        description="Send each request to one of several servers: by prompt prefix "
                    "(cache_aware), in turn, or to the least loaded; see docs/router.md.",
    )
    from framework.router.args import RouterArgs

    RouterArgs.add_cli_args(router)
    router.set_defaults(handler=_cmd_router)

    plugins = sub.add_parser("plugins", help="list registered transports, codecs, attention "
                             "and grammar backends, schedule policies, load balancers and "
                             "model architectures")
    plugins.set_defaults(handler=_cmd_plugins)

    quantize = sub.add_parser(
        "quantize", help="write a GPTQ, AWQ, FP8 or int8 copy of a float checkpoint",
        description="Quantize the linear layers' weights of a float checkpoint into a new "
                    "directory that serves as it is; see docs/quantization.md.",
    )
    from framework import cli_quantize

    cli_quantize.add_cli_args(quantize)
    quantize.set_defaults(handler=cli_quantize.run_from_cli)

    reference = sub.add_parser("reference", help="print the CLI reference (docs/cli.md)")
    reference.set_defaults(handler=lambda _: print(render_cli_reference(), end="") or 0)

    bench = sub.add_parser("bench", help="run a benchmark harness")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True
    for name, (module_name, text) in _BENCHMARKS.items():
        module = importlib.import_module(module_name)
        benchmark = bench_sub.add_parser(name, help=text)
        module.add_cli_args(benchmark)
        benchmark.set_defaults(handler=module.run_from_cli)
    return parser


def _subparser(**kwargs: object) -> argparse.ArgumentParser:
    kwargs.setdefault("formatter_class", _formatter)
    return argparse.ArgumentParser(**kwargs)  # type: ignore[arg-type]


def render_cli_reference() -> str:
    """docs/cli.md: the ``--help`` of every command, generated from the parser."""
    parser = build_parser()
    sections = [("framework", parser)]
    stack = [("framework", parser)]
    while stack:
        name, current = stack.pop(0)
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    full = f"{name} {child_name}"
                    sections.append((full, child))
                    stack.append((full, child))
    out = ["# CLI reference", "",
           "Generated from the parser by `python -m framework.cli reference`; "
           "a test keeps it in sync.", ""]
    for name, sub_parser in sections:
        out += [f"## `{name}`", "", "```text", sub_parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every command cleans up on its way out."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    # A command stopped by SIGTERM removes what it made (servers it started, socket
    # directories, model copies) as on Ctrl-C; a serving server installs its own drain.
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return handler(args)
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        code = _user_error_code(exc)
        if code is None:
            raise  # a bug: its traceback says where
        # User errors end in one line, not a traceback.
        print(f"framework: error: {exc}", file=sys.stderr)
        return code


# Errors a user can fix (a flag, a file, the machine), by class path, with their exit status;
# by name, so that a command that never loads their modules does not import them.
_USER_ERRORS = {
    "framework.runtime.launch.ComponentError": 1,  # a component could not start, or died
    "framework.comm.transport.TransportError": 2,  # a channel this machine cannot make
}


def _user_error_code(exc: Exception) -> int | None:
    """The exit status of an error printed as one line, or None for one to show in full."""
    if isinstance(exc, (ValueError, OSError)):
        return 2
    for cls in type(exc).__mro__:
        code = _USER_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return code
    return None


if __name__ == "__main__":
    sys.exit(main())
