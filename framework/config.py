"""Configuration: ``ServerArgs`` (every user-facing knob, one CLI flag each) and ``PortArgs``."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

_GROUPS = ("model", "server", "transport", "runtime", "extending", "logging")
# More torch threads than any machine has cores: a typo, which would exhaust the threads.
MAX_TORCH_THREADS = 1024
# How the Scheduler and the Detokenizer run (``--launch-mode``; framework/runtime/launch.py).
LAUNCH_MODES = ("process", "thread")


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    """A dataclass field carrying its CLI help text and group."""
    return field(default=default, metadata={"help": help, "group": group, **extra})


#: ``--speculative-num-draft-tokens`` by algorithm when not given: prompt lookup drafts
#: cost no forward, so a longer draft costs only its rows in the verify step, and each
#: request's draft grows to this many while its drafts are accepted whole
#: (``DraftLength``); a draft model's cost a forward each (bench speculative on the
#: default model: docs/speculative_decoding.md).
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 12, "draft": 3}


@dataclass(frozen=True)
class ServerArgs:
    """Everything a user can set, for the server and the offline Engine alike."""

    # model
    model_path: str | None = _opt(None, "model directory (Hugging Face layout); "
                                  "default: the embedded model", "model")
    tokenizer_path: str | None = _opt(None, "tokenizer directory (default: model path)", "model")
    served_model_name: str | None = _opt(None, "model name reported by the API", "model")
    dtype: str = _opt("auto", "weight and activation dtype", "model",
                      choices=("auto", "float32", "bfloat16", "float16"))
    load_format: str = _opt("auto", "how to load weights", "model",
                            choices=("auto", "safetensors", "dummy"))
    is_embedding: bool = _opt(False, "serve a decoder model as an embedding model", "model")
    context_length: int | None = _opt(None, "maximum tokens per request (default: the "
                                      "model's max_position_embeddings)", "model")
    chat_template: str | None = _opt(None, "chat template for /v1/chat/completions: a Jinja "
                                     "file, or the template itself if it contains '{%%' "
                                     "(default: the tokenizer's)", "model")
    tool_call_parser: str | None = _opt(None, "format of the model's tool calls, for the chat "
                                        "API's tools: hermes, qwen25, llama3, mistral, "
                                        "pythonic, or a plugin's (see `framework plugins`)",
                                        "model")
    reasoning_parser: str | None = _opt(None, "split the model's <think> reasoning into "
                                        "reasoning_content: deepseek-r1, qwen3, or a "
                                        "plugin's", "model")
    # server
    host: str = _opt("127.0.0.1", "HTTP host to listen on", "server")
    port: int = _opt(30000, "HTTP port to listen on; 0: a free port, named in the "
                     "\"framework is serving\" line", "server")
    stream_interval: int = _opt(2, "send a streamed chunk every N tokens", "server")
    max_request_bytes: int = _opt(32 * 1024 * 1024, "largest request body accepted; a larger "
                                  "one gets 413", "server")
    graceful_shutdown_timeout: float = _opt(5.0, "on SIGTERM or SIGINT, seconds to let "
                                            "requests in flight finish (no new ones are "
                                            "taken) before the rest are aborted", "server")
    api_key: str | None = _opt(None, "require `Authorization: Bearer KEY` on every route but "
                               "/health, /health_generate and /metrics", "server")
    enable_metrics: bool = _opt(False, "serve Prometheus metrics at GET /metrics", "server")
    # transport
    transport: str = _opt("zmq", "transport between processes (see `framework plugins`)",
                          "transport")
    codec: str = _opt("pickle", "codec between processes (see `framework plugins`)", "transport")
    allow_insecure_pickle: bool = _opt(False, "allow the pickle codec on tcp:// channels",
                                       "transport")
    use_tcp: bool = _opt(False, "use tcp:// channels on 127.0.0.1 instead of ipc://",
                         "transport")
    curve_key_dir: str | None = _opt(None, "directory with server.key_secret and "
                                     "client.key_secret (zmq.auth.create_certificates) for "
                                     "tcp:// CURVE authentication (default: keys made at "
                                     "start-up)", "transport")
    # runtime
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when available)", "runtime")
    attention_backend: str = _opt("auto", "attention backend (see `framework plugins`); auto: "
                                  "cpu for float32 or bfloat16 on a CPU, else torch",
                                  "runtime")
    linear_backend: str = _opt("auto", "matrix products of the linear layers and LM head: "
                               "torch (F.linear), or onednn (weights packed once after "
                               "loading, kept beside the originals: twice their memory); "
                               "auto: onednn for float32 on a CPU (torch, which is MKL, on "
                               "an Intel one), else torch", "runtime",
                               choices=("auto", "onednn", "torch"))
    quantization: str | None = _opt(None, "quantized linear layers: a checkpoint's own "
                                    "format (gptq, awq, fp8, int8; default: its "
                                    "config.json's quantization_config), or for a float "
                                    "checkpoint int8 (per-channel weight-only) or fp8 (E4M3, "
                                    "per-channel scales), quantized online "
                                    "(docs/quantization.md)",
                                    "runtime", choices=("gptq", "awq", "fp8", "int8"))
    quantized_linear_backend: str = _opt("auto", "kernel of quantized linear layers: cpu, "
                                         "cpu_a8 (4-bit and int8 products on int8 "
                                         "activations, FP8 ones of many rows on bfloat16), "
                                         "torch (the reference), or a plugin's; auto: cpu on "
                                         "a CPU, torch elsewhere", "runtime")
    quantize_lm_head: bool = _opt(False, "also quantize the LM head (where it is not tied "
                                  "to the embeddings) to int8, per channel, online "
                                  "(docs/quantization.md)", "runtime")
    quantize_embeddings: bool = _opt(False, "also quantize the token embedding table (and "
                                     "the LM head tied to it) to int8, per row, online "
                                     "(docs/quantization.md)", "runtime")
    max_running_requests: int = _opt(64, "most requests in the running batch", "runtime")
    max_queued_requests: int | None = _opt(None, "most requests in flight beyond the running "
                                           "batches; a request past it gets 503 with "
                                           "Retry-After at once (default: no limit)", "runtime")
    max_total_tokens: int | None = _opt(None, "KV cache size in tokens (default: from "
                                        "--mem-fraction)", "runtime")
    kv_cache_dtype: str = _opt("auto", "KV cache element type: auto (the model's), fp8_e4m3 "
                               "(a static scale per head) or int8 (a scale per token and "
                               "head); 8-bit codes hold about twice the tokens "
                               "(docs/quantization.md)", "runtime",
                               choices=("auto", "fp8_e4m3", "int8"))
    mem_fraction: float = _opt(0.8, "fraction of free memory for the KV cache: the GPU's; on "
                               "a CPU, a cap on its default size (of the host memory "
                               "available, shared by the machine's scheduler ranks)",
                               "runtime")
    chunked_prefill_size: int = _opt(2048, "most prompt tokens prefilled per step", "runtime")
    enable_mixed_chunk: bool = _opt(False, "run the running requests' decode tokens in the "
                                    "same step as a prefill chunk (one forward for both)",
                                    "runtime")
    overlap_schedule: str = _opt("auto", "run the Scheduler's work for the next step while "
                                 "the model computes this one: on, off, or auto (on for "
                                 "CUDA devices, off on CPUs, where the Scheduler and the "
                                 "model share the cores: docs/scheduler.md)", "runtime",
                                 choices=("auto", "on", "off"))
    disable_overlap_schedule: bool = _opt(False, "the same as --overlap-schedule off",
                                          "runtime")
    speculative_algorithm: str | None = _opt(
        None, "speculative decoding: each decode step's next tokens are drafted, by ngram "
        "from the request's own prompt and output (prompt lookup) or by draft, a smaller "
        "model (--speculative-draft-model-path), and the model verifies them in one forward "
        "(docs/speculative_decoding.md)", "runtime", choices=("ngram", "draft"))
    speculative_draft_model_path: str | None = _opt(
        None, "the draft model of --speculative-algorithm draft: a checkpoint with the served "
        "model's tokenizer (the embedded default model's is `default-draft`)", "runtime")
    speculative_num_draft_tokens: int | None = _opt(
        None, "most tokens drafted per request and step (default: 12 for ngram, whose drafts "
        "cost no forward and grow to it while accepted whole, 3 for draft, whose drafts cost "
        "one draft-model forward each; docs/speculative_decoding.md)", "runtime")
    speculative_disable_by_batch_size: int | None = _opt(
        None, "decode without drafts while more than N requests are running (a verify step "
        "costs more than a decode step when many requests share it; default: always draft)",
        "runtime")
    speculative_ngram_max: int = _opt(4, "longest tail of the request's tokens ngram matches "
                                      "against its earlier tokens", "runtime")
    schedule_policy: str = _opt("fcfs", "order of admission: fcfs (first come first served), "
                                "lpm (longest cached prefix first), or a plugin's (see "
                                "`framework plugins`)", "runtime")
    disable_radix_cache: bool = _opt(False, "do not reuse the KV of shared prefixes", "runtime")
    lora_paths: tuple[str, ...] = _opt((), "LoRA adapters (PEFT directories) served from the "
                                       "start, as NAME=DIR (docs/lora.md)", "runtime",
                                       nargs="*")
    max_loras_per_batch: int = _opt(8, "most distinct LoRA adapters in one batch", "runtime")
    max_loaded_loras: int | None = _opt(None, "LoRA adapters held in memory at once, least "
                                        "recently used evicted (default: the --lora-paths "
                                        "ones)", "runtime")
    max_lora_rank: int | None = _opt(None, "largest LoRA rank served (default: the largest "
                                     "of --lora-paths)", "runtime")
    lora_backend: str = _opt("auto", "LoRA kernel: cpu, torch (the reference), or a plugin's; "
                             "auto: cpu on a CPU, torch elsewhere", "runtime")
    random_seed: int = _opt(0, "seed for sampling without a per-request seed", "runtime")
    moe_backend: str = _opt("cpu", "kernel of Mixture-of-Experts layers: cpu (native row "
                            "kernels on a CPU, the torch reference elsewhere), torch (the "
                            "reference), or a plugin's (see `framework plugins`)", "runtime")
    grammar_backend: str = _opt("xgrammar", "backend of structured outputs (json_schema, regex, "
                                "ebnf, response_format), or none to refuse them (see "
                                "`framework plugins`)", "runtime")
    grammar_compile_timeout: float = _opt(10.0, "seconds one constraint's grammar may take to "
                                          "compile; past it, the requests waiting for it end "
                                          "with an error (finish_reason abort)", "runtime")
    grammar_cache_mb: int = _opt(256, "MiB of compiled grammars kept for reuse, the least "
                                 "recently used dropped first (0 keeps none)", "runtime")
    tp_size: int = _opt(1, "tensor-parallel size: ranks splitting each layer (heads, MLP "
                        "columns, vocabulary), over torch.distributed", "runtime")
    pp_size: int = _opt(1, "pipeline-parallel size: stages splitting the layers", "runtime")
    ep_size: int = _opt(1, "expert-parallel size of Mixture-of-Experts layers: 1, or --tp-size "
                        "to have the tensor-parallel ranks split the experts (each holding "
                        "whole experts, the tokens exchanged all-to-all) instead of every "
                        "expert's rows", "runtime")
    nnodes: int = _opt(1, "machines the dp_size × tp_size × pp_size ranks are spread over, "
                       "in order", "runtime")
    node_rank: int = _opt(0, "this machine's index among --nnodes (node 0 serves HTTP)",
                          "runtime")
    dist_init_addr: str | None = _opt(None, "host:port where the ranks meet (rank 0's "
                                      "machine; a private network only); the replicas of "
                                      "other nodes reach node 0's front on the ports after "
                                      "it; default: a free port on 127.0.0.1, one node",
                                      "runtime")
    dp_size: int = _opt(1, "data-parallel size: scheduler replicas, each holding the whole "
                        "model (over --tp-size × --pp-size ranks of its own), behind one "
                        "HTTP front", "runtime")
    load_balance_method: str = _opt("round_robin", "how the front picks the replica of each "
                                    "request with --dp-size above 1: round_robin (in turn), "
                                    "shortest_queue (the one with the fewest tokens in "
                                    "flight), or a plugin's (see `framework plugins`)",
                                    "runtime")
    launch_mode: str = _opt("process", "run the Scheduler and the Detokenizer as processes, or "
                            "as threads of the main process (for tests and debugging; the "
                            "inproc transport needs threads)", "runtime",
                            choices=LAUNCH_MODES)
    torch_threads: int | None = _opt(None, "torch threads of each Scheduler (default: the "
                                     "usable cores minus one, shared by the scheduler ranks, "
                                     "at least 1)", "runtime")
    # extending
    scheduler_class: str | None = _opt(None, "dotted path of a Scheduler subclass", "extending")
    tokenizer_manager_class: str | None = _opt(None, "dotted path of a TokenizerManager "
                                               "subclass", "extending")
    detokenizer_class: str | None = _opt(None, "dotted path of a Detokenizer subclass",
                                         "extending")
    # logging
    log_level: str = _opt("info", "log level", "logging",
                          choices=("debug", "info", "warning", "error"))
    log_requests: bool = _opt(False, "log each request's id, route, prompt length and "
                              "sampling parameters, and its finish, at INFO", "logging")

    def __post_init__(self) -> None:
        """Refuse (``ValueError``, one line on the CLI) values no component could run with."""
        problem = _first_problem([
            (0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}"),
            (self.stream_interval >= 1,
             f"--stream-interval must be at least 1, got {self.stream_interval}"),
            (self.max_request_bytes >= 1,
             f"--max-request-bytes must be at least 1, got {self.max_request_bytes}"),
            (math.isfinite(self.graceful_shutdown_timeout)
             and self.graceful_shutdown_timeout >= 0,
             f"--graceful-shutdown-timeout must be a number of seconds >= 0, got "
             f"{self.graceful_shutdown_timeout}"),
            (self.api_key != "", "--api-key must not be empty (leave it out to serve "
             "without a key)"),
            (self.max_running_requests >= 1,
             f"--max-running-requests must be at least 1, got {self.max_running_requests}"),
            (self.chunked_prefill_size >= 1,
             f"--chunked-prefill-size must be at least 1, got {self.chunked_prefill_size}"),
            (math.isfinite(self.grammar_compile_timeout) and self.grammar_compile_timeout > 0,
             f"--grammar-compile-timeout must be a number of seconds above 0, got "
             f"{self.grammar_compile_timeout}"),
            (self.grammar_cache_mb >= 0,
             f"--grammar-cache-mb must be at least 0, got {self.grammar_cache_mb}"),
            (self.overlap_schedule in ("auto", "on", "off"),
             f"--overlap-schedule must be auto, on or off, got {self.overlap_schedule!r}"),
            (not (self.disable_overlap_schedule and self.overlap_schedule == "on"),
             "--disable-overlap-schedule contradicts --overlap-schedule on"),
            (self.speculative_algorithm in (None, "ngram", "draft"),
             f"--speculative-algorithm must be ngram or draft, got "
             f"{self.speculative_algorithm!r}"),
            ((self.speculative_algorithm == "draft") == (self.speculative_draft_model_path
                                                         is not None),
             "--speculative-algorithm draft and --speculative-draft-model-path go together"),
            (self.speculative_algorithm != "draft" or self.tp_size == 1,
             "--speculative-algorithm draft runs on one rank: leave out --tp-size"),
            (self.speculative_num_draft_tokens is None or self.speculative_num_draft_tokens >= 1,
             f"--speculative-num-draft-tokens must be at least 1, got "
             f"{self.speculative_num_draft_tokens}"),
            (self.speculative_disable_by_batch_size is None
             or self.speculative_disable_by_batch_size >= 1,
             f"--speculative-disable-by-batch-size must be at least 1, got "
             f"{self.speculative_disable_by_batch_size}"),
            (self.speculative_ngram_max >= 1,
             f"--speculative-ngram-max must be at least 1, got {self.speculative_ngram_max}"),
            (self.speculative_algorithm is None or self.overlap_schedule != "on",
             "--speculative-algorithm runs without overlap scheduling: leave out "
             "--overlap-schedule on"),
            (self.speculative_algorithm is None or self.pp_size == 1,
             "--speculative-algorithm does not combine with --pp-size above 1 (the last "
             "stage samples one token per request)"),
            (self.ep_size in (1, self.tp_size),
             f"--ep-size must be 1 or equal --tp-size ({self.tp_size}), got {self.ep_size}"),
            (self.torch_threads is None or 1 <= self.torch_threads <= MAX_TORCH_THREADS,
             f"--torch-threads must be in [1, {MAX_TORCH_THREADS}], got {self.torch_threads}"),
        ])
        if problem is not None:
            raise ValueError(problem)
        self._check_registered_names()

    def _check_registered_names(self) -> None:
        """Refuse a name no registry holds now, before any model loads (nothing is imported:
        the registries list names only)."""
        from framework.registry import (
            ATTENTION_BACKENDS,
            CODECS,
            GRAMMAR_BACKENDS,
            LOAD_BALANCERS,
            MOE_BACKENDS,
            REASONING_PARSERS,
            SCHEDULE_POLICIES,
            TOOL_PARSERS,
            TRANSPORTS,
            UnknownPluginError,
        )

        for flag, value, registry, also in (
            ("--transport", self.transport, TRANSPORTS, ()),
            ("--codec", self.codec, CODECS, ()),
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS, ("auto",)),
            ("--grammar-backend", self.grammar_backend, GRAMMAR_BACKENDS, ("none",)),
            ("--moe-backend", self.moe_backend, MOE_BACKENDS, ()),
            ("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES, ()),
            ("--load-balance-method", self.load_balance_method, LOAD_BALANCERS, ()),
            ("--tool-call-parser", self.tool_call_parser, TOOL_PARSERS, ()),
            ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS, ()),
        ):
            if value is None:
                continue
            try:
                registry.check(value, also)
            except UnknownPluginError as exc:
                raise ValueError(f"{flag}: {exc}") from None

    def resolved_model_path(self) -> str:
        """The model directory to serve: the one given, or the embedded default."""
        if self.model_path:
            return self.model_path
        from framework.default_model import default_model_path

        return default_model_path()

    def resolved_draft_model_path(self) -> str | None:
        """The draft model's directory: the one given, ``default-draft`` resolved to the
        embedded default model's draft; None without one."""
        path = self.speculative_draft_model_path
        if path != "default-draft":
            return path
        from framework.default_model import default_draft_model_path

        return default_draft_model_path()

    def resolved_num_draft_tokens(self) -> int:
        """Tokens drafted per request and step: the one given, else the algorithm's default
        (``DEFAULT_NUM_DRAFT_TOKENS``)."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens
        return DEFAULT_NUM_DRAFT_TOKENS.get(self.speculative_algorithm or "", 3)

    def resolved_tokenizer_path(self) -> str:
        """The tokenizer directory: ``--tokenizer-path`` or the model directory."""
        return self.tokenizer_path or self.resolved_model_path()

    def replace(self, **changes: Any) -> ServerArgs:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per field, grouped as the dataclass groups them."""
        hints = get_type_hints(cls)
        groups = {g: parser.add_argument_group(g) for g in _GROUPS}
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            meta = f.metadata
            group = groups[meta["group"]]
            if kind is bool:
                group.add_argument(flag, action="store_true", help=meta["help"])
                continue
            base = int if "int" in str(kind) else float if "float" in str(kind) else str
            default_text = "" if f.default is None else f" (default: {f.default})"
            metavar = None if meta.get("choices") else _metavar(f.name, base)
            group.add_argument(flag, type=base, default=f.default, choices=meta.get("choices"),
                               help=meta["help"] + default_text, metavar=metavar,
                               **({"nargs": meta["nargs"]} if "nargs" in meta else {}))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        """Build from parsed arguments."""
        return cls(**{f.name: tuple(value) if isinstance(value := getattr(ns, f.name), list)
                      else value for f in fields(cls)})


def _first_problem(checks: list[tuple[bool, str]]) -> str | None:
    """The message of the first check that failed, or None."""
    return next((message for ok, message in checks if not ok), None)


def _metavar(name: str, kind: type) -> str:
    if name.endswith(("_path", "_dir")):
        return "DIR"
    if name.endswith("_class"):
        return "DOTTED.PATH"
    if name.endswith("_addr"):
        return "HOST:PORT"
    if name.endswith("_template"):
        return "FILE"
    if name.endswith("_key"):
        return "KEY"
    return {int: "N", float: "X"}.get(kind, "NAME")


@dataclass(frozen=True)
class PortArgs:
    """Every channel address of one server, made fresh for each start.

    ``ipc://`` socket files (and shared-memory wake-up files) live in a private
    0700 temporary directory, removed by ``cleanup()`` and at interpreter exit.
    """

    workdir: str
    scheduler_input: str  # TokenizerManager → Scheduler: requests and aborts
    detokenizer_input: str  # Scheduler → Detokenizer: BatchTokenIDOutput
    tokenizer_input: str  # Detokenizer → TokenizerManager: BatchStrOutput
    embedding_output: str  # Scheduler → TokenizerManager: BatchEmbeddingOutput
    rpc: str  # TokenizerManager/Engine ↔ Scheduler: flush cache, weights, info
    metrics: str  # Scheduler → main: SchedulerMetrics
    # The front (the TokenizerManager and the Detokenizer) binds every channel and the
    # Scheduler connects, even its input and RPC server: a replica on another node reaches
    # node 0, which cannot name it.
    front_binds: bool = False

    CHANNELS = (
        "scheduler_input",
        "detokenizer_input",
        "tokenizer_input",
        "embedding_output",
        "rpc",
        "metrics",
    )

    @classmethod
    def create(cls, transport: Any, tcp_host: str | None = None) -> PortArgs:
        """Addresses for every channel, made by ``transport`` in a new private directory."""
        workdir = tempfile.mkdtemp(prefix="framework-")  # mkdtemp makes it 0700
        atexit.register(shutil.rmtree, workdir, True)
        return cls(workdir, **{
            name: transport.make_address(workdir, name, tcp_host) for name in cls.CHANNELS
        })

    @classmethod
    def on_node_0(cls, host: str, first_port: int) -> PortArgs:
        """``tcp://`` addresses on node 0's ``host``, ports ``first_port`` onwards, for a
        replica whose Scheduler runs on another node (``front_binds``).

        Every node computes the same addresses from the same arguments, with no
        exchange; the ports must be free on node 0.
        """
        workdir = tempfile.mkdtemp(prefix="framework-")
        atexit.register(shutil.rmtree, workdir, True)
        shown = f"[{host}]" if ":" in host else host
        return cls(workdir, **{name: f"tcp://{shown}:{first_port + i}"
                               for i, name in enumerate(cls.CHANNELS)}, front_binds=True)

    def cleanup(self) -> None:
        """Remove the private directory and everything in it."""
        with contextlib.suppress(OSError):
            shutil.rmtree(self.workdir)
