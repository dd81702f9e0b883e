"""``framework bench transport``: throughput and one-way latency of every transport × codec pair.

For each transport a receiver runs in a second process (started with
``multiprocessing`` "spawn"), or in a second thread for a transport that
cannot cross processes (``inproc``). The parent sends sample messages to it
over the transport's raw pipe ends and it answers over a second pipe:

* data channel, parent → receiver: a message is the codec's frames followed
  by one 8-byte frame holding ``time.monotonic_ns()`` taken before encoding;
  a single-frame message is a JSON command (``begin``, ``end``, ``stop``).
* reply channel, receiver → parent: ``[b"hello"]`` once bound, ``[b"ready"]``
  after ``begin``, ``[b"ack", count]`` every few messages (a bounded window
  of messages in flight), ``[b"sum", count, latencies, type]`` after ``end``.

Each row has a throughput phase (stream for ``--seconds`` with the window
full) and a paced latency phase (one message at a time; the receiver takes
the clock after decoding, and CLOCK_MONOTONIC is system-wide, so the one-way
latency covers encode + transport + decode without queueing delay). The
``raw`` codec row sends the msgpack frames of the message, encoded once, with
no codec work on either side: the limit a codec can reach on that transport.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime
import math
import multiprocessing
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from framework.bench.environment import git_commit, machine_description
from framework.bench.messages import SAMPLE_DESCRIPTIONS, SAMPLE_MESSAGES, build_sample
from framework.comm.codec import Buffer, Codec
from framework.comm.transport import PipeReceiver, PipeSender, Transport, TransportError
from framework.messages import Message
from framework.optional import PLOTS
from framework.registry import (
    CODECS,
    TRANSPORTS,
    UnknownPluginError,
    create_codec,
    create_transport,
)

RAW_CODEC = "raw"
# The codec whose frames the raw rows send: the compact binary encoding.
RAW_FRAMES_CODEC = "msgpack"

TRANSPORT_COLUMNS = ("transport", "codec", "message", "msgs_per_s", "mb_per_s", "p50_us", "p99_us")
CODEC_COLUMNS = ("codec", "message", "encode_us", "decode_us", "bytes")

DEFAULT_SECONDS = 1.0
QUICK_SECONDS = 0.2
DEFAULT_OUTPUT = os.path.join("benchmarks", "results", "transport")

# Messages in flight are bounded by bytes so large messages do not balloon queues.
_IN_FLIGHT_BYTES = 8 << 20
_MAX_WINDOW = 128
_MIN_WINDOW = 4
# Even the slowest pair (json embeddings, tens of ms a message) gets a few samples.
_MIN_STREAMED = 3
_MIN_LATENCY_SAMPLES = 5
_STARTUP_TIMEOUT_S = 120.0
_REPLY_TIMEOUT_S = 120.0
_LIVENESS_POLL_S = 0.5
_JOIN_TIMEOUT_S = 10.0

_HELLO, _READY, _ACK, _SUMMARY = b"hello", b"ready", b"ack", b"sum"


# --------------------------------------------------------------------------- settings and rows


@dataclass(frozen=True)
class BenchSettings:
    """What to measure and for how long; build it with ``BenchSettings.create``."""

    transports: tuple[str, ...]
    codecs: tuple[str, ...]
    messages: tuple[str, ...]
    seconds: float
    latency_samples: int
    warmup: int
    quick: bool

    @classmethod
    def create(
        cls,
        transports: Sequence[str] | None = None,
        codecs: Sequence[str] | None = None,
        messages: Sequence[str] | None = None,
        seconds: float | None = None,
        quick: bool = False,
    ) -> BenchSettings:
        """Checked settings; ``None`` means every known name, and the default duration."""
        if seconds is None:
            seconds = QUICK_SECONDS if quick else DEFAULT_SECONDS
        if not seconds > 0:
            raise ValueError(f"--seconds must be > 0, got {seconds}")
        return cls(
            transports=_checked_names("transport", transports, TRANSPORTS.names()),
            codecs=_checked_names("codec", codecs, [*CODECS.names(), RAW_CODEC]),
            messages=_checked_names("message", messages, list(SAMPLE_MESSAGES)),
            seconds=float(seconds),
            latency_samples=200 if quick else 5000,
            warmup=3 if quick else 20,
            quick=quick,
        )

    @property
    def codec_seconds(self) -> float:
        """Time spent timing each of encode and decode for one codec × message."""
        return self.seconds / 4


def _checked_names(kind: str, names: Sequence[str] | None, known: list[str]) -> tuple[str, ...]:
    if names is None:
        return tuple(known)
    if not names:
        raise ValueError(f"no {kind} given; known: {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown {kind} {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
        )
    return tuple(dict.fromkeys(names))  # keep the order given, drop repeats


@dataclass(frozen=True)
class TransportRow:
    """One transport × codec × message measurement (the columns of ``transport.csv``)."""

    transport: str
    codec: str
    message: str
    msgs_per_s: float
    mb_per_s: float
    p50_us: float
    p99_us: float


@dataclass(frozen=True)
class CodecRow:
    """Codec cost without a transport (the columns of ``codec.csv``)."""

    codec: str
    message: str
    encode_us: float
    decode_us: float
    bytes: int


@dataclass
class BenchResults:
    """Everything one run measured, what it skipped, and what failed."""

    transport_rows: list[TransportRow] = field(default_factory=list)
    codec_rows: list[CodecRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class _Sample:
    """A sample message with its encoded size under each codec and the raw row's frames."""

    name: str
    message: Message
    encoded_bytes: dict[str, int]
    raw_frames: list[bytes]


def _frames_nbytes(frames: Sequence[Buffer]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def _build_samples(settings: BenchSettings) -> list[_Sample]:
    samples = []
    for name in settings.messages:
        message = build_sample(name)
        sizes = {
            codec: _frames_nbytes(create_codec(codec).encode(message))
            for codec in settings.codecs
            if codec != RAW_CODEC
        }
        raw_frames = [bytes(f) for f in create_codec(RAW_FRAMES_CODEC).encode(message)]
        sizes[RAW_CODEC] = _frames_nbytes(raw_frames)
        samples.append(_Sample(name, message, sizes, raw_frames))
    return samples


# --------------------------------------------------------------------------- codec cost


def _mean_seconds(action: Callable[[], object], budget_s: float) -> float:
    """Mean time of ``action`` over at least 3 runs and ``budget_s`` seconds, after a warm-up."""
    action()
    runs = 0
    start = time.perf_counter()
    while True:
        action()
        runs += 1
        elapsed = time.perf_counter() - start
        if runs >= 3 and elapsed >= budget_s:
            return elapsed / runs


def measure_codecs(
    settings: BenchSettings, samples: Sequence[_Sample], progress: Callable[[str], None]
) -> list[CodecRow]:
    """Encode and decode cost (µs per message, mean) of every codec × sample, no transport."""
    rows = []
    for codec_name in settings.codecs:
        if codec_name == RAW_CODEC:
            continue
        for sample in samples:
            codec = create_codec(codec_name)
            frames = codec.encode(sample.message)
            encode_s = _mean_seconds(lambda c=codec, m=sample.message: c.encode(m),
                                     settings.codec_seconds)
            decode_s = _mean_seconds(lambda c=codec, f=frames: c.decode(f), settings.codec_seconds)
            row = CodecRow(codec_name, sample.name, round(encode_s * 1e6, 2),
                           round(decode_s * 1e6, 2), _frames_nbytes(frames))
            progress(f"codec     {row.codec:<8} {row.message:<19} encode {row.encode_us:>10.1f} µs"
                     f"  decode {row.decode_us:>10.1f} µs  {row.bytes:>9,} bytes")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- receiver side


@dataclass
class _Phase:
    """The receiver's state between a ``begin`` and an ``end`` command."""

    codec: Codec | None
    ack_every: int
    record_latency: bool
    count: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    last_type: str = ""


def _command(op: str, **args: Any) -> list[bytes]:
    return [msgspec.json.encode({"op": op, **args})]


async def _receive_loop(data: PipeReceiver, replies: PipeSender) -> None:
    """Serve commands and messages until ``stop``: decode, count, time, acknowledge."""
    codecs: dict[str, Codec] = {}
    phase: _Phase | None = None
    while True:
        # Take what is waiting without touching the event loop; wait only when idle.
        frames = data.recv_frames_nowait()
        if frames is None:
            frames = await data.recv_frames()
        if len(frames) > 1:
            if phase is None:
                raise RuntimeError("benchmark receiver got a message outside a phase")
            message = phase.codec.decode(frames[:-1]) if phase.codec is not None else None
            arrived_ns = time.monotonic_ns()
            phase.count += 1
            if phase.record_latency:
                phase.latencies_ns.append(arrived_ns - int.from_bytes(frames[-1], "little"))
            if phase.count % phase.ack_every == 0:
                replies.send_frames_nowait([_ACK, phase.count.to_bytes(8, "little")])
            if message is not None:
                phase.last_type = type(message).__name__
            continue
        command = msgspec.json.decode(frames[0])
        if command["op"] == "stop":
            return
        if command["op"] == "begin":
            codec_name = command["codec"]
            if codec_name != RAW_CODEC and codec_name not in codecs:
                codecs[codec_name] = create_codec(codec_name)
            phase = _Phase(codecs.get(codec_name), command["ack_every"], command["latency"])
            replies.send_frames_nowait([_READY])
        elif command["op"] == "end" and phase is not None:
            latencies = np.asarray(phase.latencies_ns, dtype=np.int64).tobytes()
            replies.send_frames_nowait([_SUMMARY, phase.count.to_bytes(8, "little"), latencies,
                                        phase.last_type.encode()])
            phase = None


def serve_receiver(transport: Transport, data_address: str, reply_address: str) -> None:
    """Run the benchmark's receiving end: bind ``data_address``, answer on ``reply_address``."""
    data = transport.pipe_receiver(data_address)
    replies = transport.pipe_sender(reply_address)
    try:
        replies.send_frames_nowait([_HELLO])
        asyncio.run(_receive_loop(data, replies))
    finally:
        replies.close()
        data.close()


def _spawned_receiver(transport_name: str, data_address: str, reply_address: str) -> None:
    """Entry point of the receiver process: its own transport instance, made by name."""
    from framework.runtime.launch import die_with_parent

    die_with_parent()  # a harness killed mid-run must not leave its receiver behind
    serve_receiver(create_transport(transport_name), data_address, reply_address)


class _ReceiverHandle:
    """The receiver's process or thread: liveness checks and shutdown."""

    def __init__(self, transport_name: str, transport: Transport, data_address: str,
                 reply_address: str) -> None:
        self.error: BaseException | None = None
        self.process: Any = None
        self.thread: threading.Thread | None = None
        if _crosses_processes(transport):
            context = multiprocessing.get_context("spawn")
            self.process = context.Process(
                target=_spawned_receiver, args=(transport_name, data_address, reply_address),
                name=f"bench-receiver-{transport_name}", daemon=True,
            )
            self.process.start()
        else:
            self.thread = threading.Thread(
                target=self._run_in_thread, args=(transport, data_address, reply_address),
                name=f"bench-receiver-{transport_name}", daemon=True,
            )
            self.thread.start()

    def _run_in_thread(self, transport: Transport, data_address: str, reply_address: str) -> None:
        try:
            serve_receiver(transport, data_address, reply_address)
        except BaseException as exc:  # handed to the parent, which reports it
            self.error = exc

    def raise_if_dead(self) -> None:
        """Raise if the receiver ended while the parent still waits for it."""
        if self.process is not None and not self.process.is_alive():
            raise RuntimeError(f"the benchmark receiver process exited with code "
                               f"{self.process.exitcode}")
        if self.thread is not None and not self.thread.is_alive():
            raise RuntimeError(f"the benchmark receiver thread ended: {self.error!r}")

    def join(self) -> None:
        """Wait for the receiver to end (after ``stop``); end a process that does not."""
        if self.thread is not None:
            self.thread.join(_JOIN_TIMEOUT_S)
            return
        self.process.join(_JOIN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_JOIN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()


def _crosses_processes(transport: Transport) -> bool:
    """Whether the transport's channels reach another process (inproc refuses to be pickled)."""
    try:
        pickle.dumps(transport)
    except TransportError:
        return False
    return True


# --------------------------------------------------------------------------- sender side


async def _next_reply(replies: PipeReceiver, handle: _ReceiverHandle,
                      timeout_s: float = _REPLY_TIMEOUT_S) -> list[Buffer]:
    """The receiver's next reply; raises if it dies or stays silent for ``timeout_s``."""
    frames = replies.recv_frames_nowait()
    if frames is not None:
        return frames
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(replies.recv_frames(), _LIVENESS_POLL_S)
        except asyncio.TimeoutError:
            handle.raise_if_dead()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no reply from the benchmark receiver in {timeout_s} s"
                ) from None


async def _expect(replies: PipeReceiver, handle: _ReceiverHandle, kind: bytes,
                  timeout_s: float = _REPLY_TIMEOUT_S) -> list[Buffer]:
    """The next reply, which must be of ``kind`` (acks of an earlier phase are skipped)."""
    while True:
        frames = await _next_reply(replies, handle, timeout_s)
        if bytes(frames[0]) == kind:
            return frames
        if bytes(frames[0]) != _ACK:
            raise RuntimeError(f"expected {kind!r} from the receiver, got {bytes(frames[0])!r}")


class _Link:
    """The parent's ends of one receiver: commands, acks and phase summaries."""

    def __init__(self, data: PipeSender, replies: PipeReceiver, handle: _ReceiverHandle) -> None:
        self.data = data
        self.replies = replies
        self.handle = handle

    async def expect(self, kind: bytes) -> list[Buffer]:
        """The next reply of ``kind``."""
        return await _expect(self.replies, self.handle, kind)

    async def begin(self, codec: str, ack_every: int, latency: bool) -> None:
        """Start a phase: the receiver decodes with ``codec`` (none for raw) from now on."""
        await self.data.send_frames(_command("begin", codec=codec, ack_every=ack_every,
                                             latency=latency))
        await self.expect(_READY)

    async def end(self) -> tuple[int, np.ndarray, str]:
        """Close the phase: messages received, their latencies (ns), the last decoded type."""
        await self.data.send_frames(_command("end"))
        _, count, latencies, last_type = await self.expect(_SUMMARY)
        return (int.from_bytes(count, "little"), np.frombuffer(latencies, dtype=np.int64),
                bytes(last_type).decode())

    async def acked_count(self) -> int:
        """Wait for one ack, then take every other waiting one; the highest count received."""
        frames = await self.expect(_ACK)
        count = int.from_bytes(frames[1], "little")
        while (more := self.replies.recv_frames_nowait()) is not None:
            if bytes(more[0]) != _ACK:
                raise RuntimeError(f"expected acks from the receiver, got {bytes(more[0])!r}")
            count = max(count, int.from_bytes(more[1], "little"))
        return count


def _stamped_encoder(codec_name: str, sample: _Sample) -> Callable[[], list[Buffer]]:
    """A function producing one message's frames: encoded now, then the send-time stamp."""
    if codec_name == RAW_CODEC:
        raw = sample.raw_frames

        def encode_raw() -> list[Buffer]:
            return [*raw, time.monotonic_ns().to_bytes(8, "little")]

        return encode_raw
    codec = create_codec(codec_name)
    message = sample.message

    def encode() -> list[Buffer]:
        stamp = time.monotonic_ns()  # before encoding, so the latency includes it
        frames = codec.encode(message)
        frames.append(stamp.to_bytes(8, "little"))
        return frames

    return encode


def _flow_control(message_bytes: int) -> tuple[int, int]:
    """Messages allowed in flight, and how often the receiver acknowledges."""
    window = max(_MIN_WINDOW, min(_MAX_WINDOW, _IN_FLIGHT_BYTES // max(message_bytes, 1)))
    return window, max(1, window // 4)


async def _stream(link: _Link, codec_name: str, encode: Callable[[], list[Buffer]],
                  message_bytes: int, seconds: float) -> float:
    """Messages per second of a sender streaming as fast as the window lets it for ``seconds``."""
    window, ack_every = _flow_control(message_bytes)
    await link.begin(codec_name, ack_every, latency=False)
    sent = acked = 0
    start = time.perf_counter()
    deadline = start + seconds
    while sent < _MIN_STREAMED or time.perf_counter() < deadline:
        if sent - acked >= window:
            acked = await link.acked_count()
        await link.data.send_frames(encode())
        sent += 1
    received, _, _ = await link.end()  # every message decoded by the time the summary comes
    elapsed = time.perf_counter() - start
    if received != sent:
        raise RuntimeError(f"the receiver got {received} of {sent} messages")
    return sent / elapsed


async def _paced(link: _Link, codec_name: str, encode: Callable[[], list[Buffer]],
                 settings: BenchSettings, expected_type: str) -> np.ndarray:
    """One-way latencies (ns) of messages sent one at a time, each after the last was decoded."""
    await link.begin(codec_name, ack_every=1, latency=True)
    deadline = time.perf_counter() + settings.seconds
    sent = 0
    while sent < settings.warmup + _MIN_LATENCY_SAMPLES or (
        sent < settings.warmup + settings.latency_samples and time.perf_counter() < deadline
    ):
        await link.data.send_frames(encode())
        await link.expect(_ACK)
        sent += 1
    received, latencies, last_type = await link.end()
    if received != sent or len(latencies) != sent:
        raise RuntimeError(f"the receiver timed {len(latencies)} of {sent} messages")
    if codec_name != RAW_CODEC and last_type != expected_type:
        raise RuntimeError(f"the receiver decoded a {last_type}, not a {expected_type}")
    return latencies[settings.warmup :]


async def _measure_transport(
    transport_name: str, transport: Transport, workdir: str, samples: Sequence[_Sample],
    settings: BenchSettings, progress: Callable[[str], None],
) -> list[TransportRow]:
    data_address = transport.make_address(workdir, "bench-data")
    reply_address = transport.make_address(workdir, "bench-replies")
    replies = transport.pipe_receiver(reply_address)
    handle: _ReceiverHandle | None = None
    data: PipeSender | None = None
    try:
        handle = _ReceiverHandle(transport_name, transport, data_address, reply_address)
        # Connect only once the receiver has bound, for transports that need that order.
        await _expect(replies, handle, _HELLO, _STARTUP_TIMEOUT_S)
        data = transport.pipe_sender(data_address)
        link = _Link(data, replies, handle)
        rows = []
        for codec_name in settings.codecs:
            for sample in samples:
                row = await _measure_row(link, transport_name, codec_name, sample, settings)
                progress(_format_row(row))
                rows.append(row)
        return rows
    finally:
        if handle is not None:
            if data is not None:
                # The receiver may already be gone; shutting down goes on regardless.
                with contextlib.suppress(TransportError, OSError):
                    data.send_frames_nowait(_command("stop"))
            handle.join()
        if data is not None:
            data.close()
        replies.close()


async def _measure_row(link: _Link, transport_name: str, codec_name: str, sample: _Sample,
                       settings: BenchSettings) -> TransportRow:
    encode = _stamped_encoder(codec_name, sample)
    message_bytes = sample.encoded_bytes[codec_name]
    rate = await _stream(link, codec_name, encode, message_bytes, settings.seconds)
    latencies_us = await _paced(link, codec_name, encode, settings,
                                type(sample.message).__name__) / 1e3
    p50, p99 = np.percentile(latencies_us, [50, 99])
    return TransportRow(transport_name, codec_name, sample.name, round(rate, 1),
                        round(rate * message_bytes / 1e6, 3), round(float(p50), 1),
                        round(float(p99), 1))


def _format_row(row: TransportRow) -> str:
    return (f"{row.transport:<9} {row.codec:<8} {row.message:<19} {row.msgs_per_s:>12,.0f} msg/s"
            f" {row.mb_per_s:>10,.2f} MB/s  p50 {row.p50_us:>9,.1f} µs  p99 {row.p99_us:>9,.1f} µs")


def _load_transports(names: Sequence[str], results: BenchResults,
                     note: Callable[[str], None]) -> list[tuple[str, Transport]]:
    """Instances of the named transports; one that cannot be imported is skipped with a note."""
    loaded = []
    for name in names:
        try:
            loaded.append((name, TRANSPORTS.get(name)()))
        except UnknownPluginError as exc:
            results.skipped.append(f"{name}: {exc}")
            note(f"note: skipping transport {name!r}, it cannot be loaded: {exc}")
    return loaded


# --------------------------------------------------------------------------- the whole run


def run_benchmark(settings: BenchSettings, output_dir: str | os.PathLike[str],
                  progress: Callable[[str], None] | None = None) -> BenchResults:
    """Measure every pair and message in ``settings``; write the CSVs, the table and the plot.

    A transport that cannot be loaded is skipped with a note; one that fails
    while measured is reported in ``failed`` and the run goes on without it.
    """
    progress = progress or _print_line
    results = BenchResults()
    samples = _build_samples(settings)
    results.codec_rows = measure_codecs(settings, samples, progress)
    for name, transport in _load_transports(settings.transports, results, _print_note):
        try:
            # A private directory per transport for socket files, removed with everything in it.
            with tempfile.TemporaryDirectory(prefix="framework-bench-") as workdir:
                results.transport_rows += asyncio.run(
                    _measure_transport(name, transport, workdir, samples, settings, progress)
                )
        except Exception as exc:  # a broken plugin must not lose the other transports' rows
            traceback.print_exc()
            results.failed.append(f"{name}: {exc}")
            _print_note(f"error: transport {name!r} failed, its rows are missing: {exc}")
    results.written = write_results(results, settings, Path(output_dir))
    return results


def _print_line(line: str) -> None:
    print(line, flush=True)


def _print_note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_results(results: BenchResults, settings: BenchSettings, output_dir: Path) -> list[Path]:
    """Write ``transport.csv``, ``codec.csv``, ``transport.md`` and (with matplotlib) the plot."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = [output_dir / name for name in ("transport.csv", "codec.csv", "transport.md")]
    _write_csv(written[0], TRANSPORT_COLUMNS, results.transport_rows)
    _write_csv(written[1], CODEC_COLUMNS, results.codec_rows)
    written[2].write_text(render_markdown(results, settings), encoding="utf-8")
    if write_plot(results.transport_rows, output_dir / "transport.png"):
        written.append(output_dir / "transport.png")
    return written


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[Any]) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(columns)
        writer.writerows(astuple(row) for row in rows)


def render_markdown(results: BenchResults, settings: BenchSettings) -> str:
    """The results as Markdown tables, headed by the machine, the commit and the settings."""
    lines = [
        "# Transport benchmark",
        "",
        f"- Machine: {machine_description()}",
        f"- Python {platform.python_version()}, commit {git_commit()}",
        f"- Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{settings.seconds:g} s per phase{' (--quick)' if settings.quick else ''}; "
        f"latency over up to {settings.latency_samples} paced messages after "
        f"{settings.warmup} warm-up ones",
        "- msgs/s and MB/s: streaming with a bounded window; p50/p99: one-way latency "
        "(encode + transport + decode) of paced messages. MB = 10^6 bytes of encoded frames.",
        f"- Codec raw: the {RAW_FRAMES_CODEC} frames of the message, encoded once and sent "
        "with no codec work on either side (the transport's limit).",
    ]
    lines += [f"- Skipped: {s}" for s in results.skipped]
    lines += [f"- Failed: {f}" for f in results.failed]
    lines += ["", "| transport | codec | message | msgs/s | MB/s | p50 µs | p99 µs |",
              "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r.transport} | {r.codec} | {r.message} | {r.msgs_per_s:,.0f} | "
              f"{r.mb_per_s:,.2f} | {r.p50_us:,.1f} | {r.p99_us:,.1f} |"
              for r in results.transport_rows]
    lines += ["", "## Codec cost, no transport (mean µs per message)", "",
              "| codec | message | encode µs | decode µs | bytes |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r.codec} | {r.message} | {r.encode_us:,.1f} | {r.decode_us:,.1f} | "
              f"{r.bytes:,} |" for r in results.codec_rows]
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[TransportRow], path: Path) -> bool:
    """A bar chart of msgs/s per pair, one panel per message; ``False`` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        _print_note(f"note: matplotlib is not installed, so {path.name} is not drawn "
                    f"({PLOTS.install})")
        return False
    messages = list(dict.fromkeys(r.message for r in rows))
    if not messages:
        return False
    pairs = list(dict.fromkeys(f"{r.transport}/{r.codec}" for r in rows))
    transports = list(dict.fromkeys(r.transport for r in rows))
    figure = Figure(figsize=(8, len(messages) * (0.25 * len(pairs) + 1.0)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(messages), 1, squeeze=False)[:, 0]
    for ax, message in zip(axes, messages):
        by_pair = {f"{r.transport}/{r.codec}": r for r in rows if r.message == message}
        shown = [p for p in pairs if p in by_pair]
        rates = [by_pair[p].msgs_per_s for p in shown]
        bars = ax.barh(shown, rates,
                       color=[f"C{transports.index(by_pair[p].transport)}" for p in shown])
        ax.bar_label(bars, [f"{rate:,.0f}" for rate in rates], padding=2, fontsize="x-small")
        ax.set_xscale("log")
        # Bars start at a power of ten below the slowest pair, so every bar shows its length.
        ax.set_xlim(10 ** math.floor(math.log10(min(rates))), max(rates) * 4)
        ax.invert_yaxis()
        ax.set_title(message, loc="left", fontsize="medium")
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[-1].set_xlabel("messages per second (log scale)")
    figure.savefig(path, dpi=110)
    return True


# --------------------------------------------------------------------------- command line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``framework bench transport``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the message list's lines
    parser.description = (
        "Measure messages/s, MB/s and one-way p50/p99 latency of every transport x codec pair\n"
        "between two processes (two threads for inproc), plus a 'raw' row per transport\n"
        "(pre-encoded frames, no codec) and the codec-only encode/decode cost."
    )
    parser.epilog = "sample messages (--messages):\n" + "\n".join(
        f"  {name:<20} {text}" for name, text in SAMPLE_DESCRIPTIONS.items()
    )
    parser.add_argument("--transports", type=_comma_list, default=None, metavar="LIST",
                        help="comma-separated transports (default: every registered one)")
    parser.add_argument("--codecs", type=_comma_list, default=None, metavar="LIST",
                        help="comma-separated codecs, 'raw' included (default: every registered "
                        "one and raw)")
    parser.add_argument("--messages", type=_comma_list, default=None, metavar="LIST",
                        help="comma-separated sample messages, listed below (default: all)")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"seconds per phase for each pair and message (default: "
                        f"{DEFAULT_SECONDS:g}, or {QUICK_SECONDS:g} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (under a minute on two cores) for a first look")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, metavar="DIR",
                        help="directory for transport.csv, transport.md, codec.csv and "
                        f"transport.png (default: {DEFAULT_OUTPUT})")


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def run_from_cli(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed arguments; 1 if a transport failed, else 0."""
    settings = BenchSettings.create(transports=args.transports, codecs=args.codecs,
                                    messages=args.messages, seconds=args.seconds,
                                    quick=args.quick)
    started = time.perf_counter()
    results = run_benchmark(settings, args.output)
    print(f"wrote {', '.join(p.name for p in results.written)} to {args.output} "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return 1 if results.failed else 0


__all__ = [
    "BenchResults", "BenchSettings", "CodecRow", "TransportRow", "add_cli_args",
    "measure_codecs", "run_benchmark", "run_from_cli", "serve_receiver",
]
