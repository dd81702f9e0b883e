"""``RouterArgs``: the router's settings and their command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from framework.router.policies import POLICIES, CacheAwareSettings


@dataclass
class RouterArgs:
    """Everything ``framework router`` is told on its command line."""

    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    forward_api_key: bool = False
    worker_api_key: str | None = None
    health_check_interval: float = 5.0
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5
    max_tree_chars: int = 1 << 22
    request_timeout: float = 600.0
    graceful_shutdown_timeout: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (bool(self.worker_urls), "give at least one --worker-url"),
            (self.policy in POLICIES, f"--policy must be one of {', '.join(POLICIES)}"),
            (self.health_check_interval > 0, "--health-check-interval must be > 0"),
            (0.0 <= self.cache_threshold <= 1.0, "--cache-threshold must be in [0, 1]"),
            (self.max_tree_chars > 0, "--max-tree-chars must be > 0"),
            (self.request_timeout > 0, "--request-timeout must be > 0"),
            (not (self.forward_api_key and self.worker_api_key),
             "--forward-api-key and --worker-api-key exclude each other"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def cache_aware(self) -> CacheAwareSettings:
        """The thresholds of the ``cache_aware`` policy."""
        return CacheAwareSettings(self.cache_threshold, self.balance_abs_threshold,
                                  self.balance_rel_threshold, self.max_tree_chars)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The router's flags, defaults from the dataclass."""
        d = RouterArgs.__dataclass_fields__
        add = parser.add_argument
        add("--worker-url", dest="worker_urls", nargs="+", required=True, metavar="URL",
            help="base URLs of the OpenAI-compatible servers to route to")
        add("--policy", choices=POLICIES, default=d["policy"].default,
            help="how a worker is chosen (default: %(default)s)")
        add("--host", default=d["host"].default, help="address to listen on")
        add("--port", type=int, default=d["port"].default, help="port (0: a free one)")
        add("--api-key", default=None, metavar="KEY",
            help="require `Authorization: Bearer KEY` from clients")
        add("--forward-api-key", action="store_true",
            help="send the client's Authorization header on to the workers")
        add("--worker-api-key", default=None, metavar="KEY",
            help="send `Authorization: Bearer KEY` to the workers")
        add("--health-check-interval", type=float, default=d["health_check_interval"].default,
            metavar="S", help="seconds between checks of each worker's /health")
        add("--balance-abs-threshold", type=int, default=d["balance_abs_threshold"].default,
            metavar="N", help="cache_aware: imbalanced when max - min load exceeds N ...")
        add("--balance-rel-threshold", type=float,
            default=d["balance_rel_threshold"].default, metavar="R",
            help="... and max load exceeds R x min load")
        add("--cache-threshold", type=float, default=d["cache_threshold"].default, metavar="F",
            help="cache_aware: least share of the prompt a worker's prefix must match")
        add("--max-tree-chars", type=int, default=d["max_tree_chars"].default, metavar="N",
            help="cache_aware: characters each worker's prefix tree holds at most")
        add("--request-timeout", type=float, default=d["request_timeout"].default,
            metavar="S", help="seconds a worker may take to answer a request")
        add("--graceful-shutdown-timeout", type=float,
            default=d["graceful_shutdown_timeout"].default, metavar="S",
            help="seconds requests in flight may finish after SIGINT/SIGTERM")
        add("--log-level", default=d["log_level"].default,
            choices=["debug", "info", "warning", "error"], help="logging level")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RouterArgs:
        """The settings from parsed flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
