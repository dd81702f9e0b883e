"""A small generic registry filled by built-ins and by Python entry points.

Entries are stored as ``"module:attribute"`` paths and imported only when
asked for, so listing plugins imports nothing heavy and nothing imports
Triton unless a Triton backend is requested.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from framework.optional import optional_part

T = TypeVar("T")


class UnknownPluginError(ValueError):
    """A name that no built-in or entry point registered."""


@dataclass(frozen=True)
class RegistryEntry:
    """Where a registered name comes from and what it points to."""

    name: str
    target: str
    source: str


class Registry(Generic[T]):
    """Names → lazily imported objects, for one kind of plugin.

    ``group`` is the entry-point group scanned (once, on first lookup) for
    third-party plugins; ``register`` adds built-ins or test doubles. ``plural``
    names the kind in listings (default: ``kind`` + "s").
    """

    def __init__(self, kind: str, group: str, plural: str | None = None) -> None:
        self.kind = kind
        self.group = group
        self.plural = plural or f"{kind}s"
        self._entries: dict[str, RegistryEntry] = {}
        self._loaded: dict[str, T] = {}
        self._scanned = False
        self._lock = threading.Lock()

    def register(self, name: str, target: str | T, source: str = "built-in") -> None:
        """Register ``target`` (an object or a ``"module:attr"`` path) under ``name``."""
        with self._lock:
            if isinstance(target, str):
                self._entries[name] = RegistryEntry(name, target, source)
                self._loaded.pop(name, None)
            else:
                module = getattr(target, "__module__", "?")
                path = f"{module}:{getattr(target, '__qualname__', '?')}"
                self._entries[name] = RegistryEntry(name, path, source)
                self._loaded[name] = target

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test double registered for one test); absent names are ignored."""
        with self._lock:
            self._entries.pop(name, None)
            self._loaded.pop(name, None)

    def get(self, name: str) -> T:
        """The object registered as ``name``; unknown names list the known ones."""
        self._scan()
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            entry = self._entries.get(name)
        if entry is None:
            raise UnknownPluginError(self.unknown_message(name))
        obj = _import(entry.target, f"{self.kind} {name!r} ({entry.source})")
        with self._lock:
            self._loaded[name] = obj
        return obj

    def unknown_message(self, name: str, also: tuple[str, ...] = ()) -> str:
        """Why ``name`` is not here: an optional part to install, or a typo among the known
        (the registered names and ``also``)."""
        part = optional_part(self.kind, name)
        if part is not None and not part.installed():
            return part.missing_message()
        known = ", ".join([*also, *sorted(self._entries)]) or "none"
        return f"unknown {self.kind} {name!r}; known: {known}"

    def check(self, name: str, also: tuple[str, ...] = ()) -> None:
        """Refuse (``UnknownPluginError``) a name that is neither registered nor in ``also``,
        without importing anything."""
        if name not in also and name not in self.names():
            raise UnknownPluginError(self.unknown_message(name, also))

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._scan()
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry]:
        """Every entry, sorted by name."""
        self._scan()
        return [self._entries[n] for n in sorted(self._entries)]

    def _scan(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        for ep in entry_points(group=self.group):
            dist = getattr(ep, "dist", None)
            source = f"entry point of {dist.name} {dist.version}" if dist else "entry point"
            # Built-ins win a name clash: a plugin cannot silently replace them.
            if ep.name not in self._entries:
                self._entries[ep.name] = RegistryEntry(ep.name, ep.value, source)


def _import(target: str, what: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise UnknownPluginError(f"cannot load {what} from {target}: {exc}") from exc
    return obj


def import_dotted(path: str) -> Any:
    """Import ``"package.module.Name"`` or ``"package.module:Name"`` (for --*-class flags)."""
    if ":" not in path:
        module, _, attr = path.rpartition(".")
        path = f"{module}:{attr}"
    return _import(path, path)


TRANSPORTS: Registry[Any] = Registry("transport", "framework.transports")
CODECS: Registry[Any] = Registry("codec", "framework.codecs")
# Attention backends are classes built once per rank as ``ATTENTION_BACKENDS.get(name)(args)``
# with an ``AttentionBackendArgs`` (see framework/layers/attention/base.py).
ATTENTION_BACKENDS: Registry[Any] = Registry("attention backend", "framework.attention_backends")
# Grammar backends are ``GrammarBackend`` subclasses (framework/constrained/base.py), built once
# per Scheduler on the first constrained request.
GRAMMAR_BACKENDS: Registry[Any] = Registry("grammar backend", "framework.grammar_backends")
# Schedule policies (``--schedule-policy``) are ``SchedulePolicy`` subclasses
# (framework/runtime/scheduler/policy.py), built once per Scheduler as ``cls(prefix_cache)``; their
# ``order(waiting)`` reorders the waiting queue in place before each prefill selection.
SCHEDULE_POLICIES: Registry[Any] = Registry(
    "schedule policy", "framework.schedule_policies", plural="schedule policies")
# Load balancers (``--load-balance-method``) are ``LoadBalancer`` subclasses
# (framework/runtime/data_parallel.py), built once per data-parallel front as ``cls()``; their
# ``choose(loads, msg)`` returns the index of the replica that gets a new request.
LOAD_BALANCERS: Registry[Any] = Registry("load balancer", "framework.load_balancers")
# MoE kernels are functions ``kernel(x, w13, w2, weights, ids, act, first_expert) -> [n, H]``
# (framework/layers/moe/torch_moe.py is the reference), picked by ``FusedMoE``.
MOE_BACKENDS: Registry[Any] = Registry("moe backend", "framework.moe_backends")
# Tool-call parsers (``--tool-call-parser``) are ``ToolParser`` subclasses
# (framework/tool_parsers/base.py), built once per output choice as ``cls(tools)``.
TOOL_PARSERS: Registry[Any] = Registry("tool-call parser", "framework.tool_parsers")
# Reasoning parsers (``--reasoning-parser``) are ``ReasoningParser`` subclasses
# (framework/reasoning_parsers.py), built once per output choice as ``cls(thinking)``.
REASONING_PARSERS: Registry[Any] = Registry("reasoning parser", "framework.reasoning_parsers")
# LoRA kernels are functions ``kernel(x, a, b, scalings, batch) -> [n, out]``: the sum of each
# row's adapter product, for the rows' slots in ``batch`` (framework/lora/ops.py).
LORA_BACKENDS: Registry[Any] = Registry("lora backend", "framework.lora_backends")
# Quantized-linear kernels are classes built once per layer kind as ``cls()``; ``prepare``
# repacks a loaded ``QuantizedWeight`` once and ``apply(weight, x, bias)`` multiplies by it
# (framework/layers/quantization/).
QUANT_LINEAR_BACKENDS: Registry[Any] = Registry(
    "quantized linear backend", "framework.quantized_linear_backends")

TRANSPORTS.register("zmq", "framework.comm.zmq:ZmqTransport")
TRANSPORTS.register("inproc", "framework.comm.inproc:InprocTransport")
TRANSPORTS.register("shm", "framework.comm.shm:ShmTransport")
CODECS.register("pickle", "framework.comm.codec:PickleCodec")
CODECS.register("msgpack", "framework.comm.codec:MsgpackCodec")
CODECS.register("json", "framework.comm.codec:JsonCodec")
ATTENTION_BACKENDS.register(
    "torch", "framework.layers.attention.torch_native:TorchNativeAttnBackend"
)
ATTENTION_BACKENDS.register("cpu", "framework.layers.attention.cpu_native:CpuNativeAttnBackend")
GRAMMAR_BACKENDS.register("xgrammar", "framework.constrained.xgrammar_backend:XGrammarBackend")
SCHEDULE_POLICIES.register("fcfs", "framework.runtime.scheduler.policy:FcfsPolicy")
SCHEDULE_POLICIES.register("lpm", "framework.runtime.scheduler.policy:LpmPolicy")
LOAD_BALANCERS.register("round_robin", "framework.runtime.data_parallel:RoundRobin")
LOAD_BALANCERS.register("shortest_queue", "framework.runtime.data_parallel:ShortestQueue")
MOE_BACKENDS.register("torch", "framework.layers.moe.torch_moe:torch_fused_experts")
MOE_BACKENDS.register("cpu", "framework.layers.moe.cpu_moe:cpu_fused_experts")
TOOL_PARSERS.register("hermes", "framework.tool_parsers.hermes:HermesToolParser")
TOOL_PARSERS.register("qwen25", "framework.tool_parsers.hermes:HermesToolParser")
TOOL_PARSERS.register("llama3", "framework.tool_parsers.llama3:Llama3ToolParser")
TOOL_PARSERS.register("mistral", "framework.tool_parsers.mistral:MistralToolParser")
TOOL_PARSERS.register("pythonic", "framework.tool_parsers.pythonic:PythonicToolParser")
REASONING_PARSERS.register("deepseek-r1", "framework.reasoning_parsers:DeepSeekR1ReasoningParser")
REASONING_PARSERS.register("qwen3", "framework.reasoning_parsers:Qwen3ReasoningParser")
LORA_BACKENDS.register("torch", "framework.lora.ops:torch_lora_delta")
LORA_BACKENDS.register("cpu", "framework.lora.ops:cpu_lora_delta")
QUANT_LINEAR_BACKENDS.register(
    "torch", "framework.layers.quantization.torch_kernels:TorchQuantLinear")
QUANT_LINEAR_BACKENDS.register("cpu", "framework.layers.quantization.cpu_kernels:CpuQuantLinear")
QUANT_LINEAR_BACKENDS.register(
    "cpu_a8", "framework.layers.quantization.cpu_kernels:CpuInt8ActivationLinear")

REGISTRIES: tuple[Registry[Any], ...] = (TRANSPORTS, CODECS, ATTENTION_BACKENDS, GRAMMAR_BACKENDS,
                                         SCHEDULE_POLICIES, LOAD_BALANCERS, MOE_BACKENDS,
                                         TOOL_PARSERS, REASONING_PARSERS, LORA_BACKENDS,
                                         QUANT_LINEAR_BACKENDS)


def create_transport(name: str, **options: Any) -> Any:
    """A new transport instance by name (``options`` go to its constructor)."""
    return TRANSPORTS.get(name)(**options)


def create_codec(name: str) -> Any:
    """A new codec instance by name; each channel end gets its own."""
    return CODECS.get(name)()
