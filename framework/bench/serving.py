"""``framework bench serving``: a streaming load generator for an OpenAI-compatible server.

It sends ``--num-prompts`` streaming ``POST /v1/completions`` requests to one
server (ours, SGLang, vLLM, ...) and measures each one from the client's side:

* **TTFT**: from sending the request to the first chunk with non-empty text.
* **ITL**: the gap between two text chunks divided by the tokens the later
  chunk carried. A server sends a chunk every ``stream_interval`` tokens, so
  every chunk is taken to carry that many and the last one the rest (the
  completion token count comes from the stream's final usage chunk); when the
  chunks do not fit that pattern the tokens are spread evenly over them.
* **TPOT**: ``(e2e - TTFT) / (completion tokens - 1)``.
* **E2E**: from sending the request to ``data: [DONE]``.

Prompts are random English words from a fixed list, seeded. Their token counts
are set by a calibration made before the run: a few one-token completion
requests tell how many tokens the server's tokenizer makes per word and how
many it adds to every prompt (a BOS token, say), and each prompt gets the
number of words for its target length. The server's
``usage.prompt_tokens`` of every request is what the results count; the
target length is recorded next to it.

Requests arrive as a Poisson process of ``--request-rate`` per second (all at
once with ``inf``), and ``--max-concurrency`` bounds how many are in flight.
Every request has a timeout and the whole run a limit; requests only go to
the given base URL (no proxy from the environment, no redirects).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from framework.bench.environment import git_commit, machine_description
from framework.optional import PLOTS

DEFAULT_OUTPUT = "benchmarks/results/serving"
DEFAULT_BASE_URL = "http://127.0.0.1:30000"
LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
_PROBE_TIMEOUT = 30.0  # seconds for the requests made before the run (models, calibration)
_SMALL_PROBE_WORDS = 8
_LARGE_PROBE_WORDS = 256
_PROBE_TEXTS = 8

# Common English words; random sequences of them tokenize at a steady rate per word.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this
from or had by word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like
so these her long make thing see him two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find
any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell
does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north
"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class ServingBenchSettings:
    """The server to load, the workload and the limits of one run."""

    base_url: str = DEFAULT_BASE_URL
    # None: the first model of GET /v1/models; several names, comma-separated, are asked for
    # in turn (request i names the i-th modulo their count: LoRA adapters, say).
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 200
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    shared_prefix_groups: int = 0
    shared_prefix_len: int = 0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    stream_interval: int | None = None  # None: the server's, from /get_server_info, else 1
    request_timeout: float = 600.0
    max_duration: float = 3600.0
    output: str = DEFAULT_OUTPUT
    run_name: str = "serving"
    plot: bool = False
    progress: bool = True

    def validate(self) -> None:
        """Refuse values that cannot make a run, naming the flag."""
        checks = [
            (self.base_url.startswith(("http://", "https://")),
             f"--base-url must start with http:// or https://, got {self.base_url!r}"),
            (self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}"),
            (self.input_len >= 1, f"--input-len must be >= 1, got {self.input_len}"),
            (self.output_len >= 1, f"--output-len must be >= 1, got {self.output_len}"),
            (0.0 <= self.range_ratio <= 1.0,
             f"--range-ratio must be in [0, 1], got {self.range_ratio}"),
            (self.shared_prefix_groups >= 0,
             f"--shared-prefix-groups must be >= 0, got {self.shared_prefix_groups}"),
            (self.shared_prefix_len >= 0,
             f"--shared-prefix-len must be >= 0, got {self.shared_prefix_len}"),
            ((self.shared_prefix_groups > 0) == (self.shared_prefix_len > 0),
             "--shared-prefix-groups and --shared-prefix-len go together"),
            (self.request_rate > 0, f"--request-rate must be > 0, got {self.request_rate}"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency must be >= 1, got {self.max_concurrency}"),
            (self.stream_interval is None or self.stream_interval >= 1,
             f"--stream-interval must be >= 1, got {self.stream_interval}"),
            (self.request_timeout > 0,
             f"--request-timeout must be > 0, got {self.request_timeout}"),
            (self.max_duration > 0, f"--max-duration must be > 0, got {self.max_duration}"),
            (bool(self.run_name) and "/" not in self.run_name,
             f"--run-name must be a plain file name, got {self.run_name!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def root_url(self) -> str:
        """The base URL without a trailing ``/`` or ``/v1``, so both spellings work."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class Prompt:
    """One request to send: its text and the lengths it aims at."""

    index: int
    text: str
    input_len: int  # target prompt tokens (shared prefix included)
    output_len: int  # max_tokens, with ignore_eos
    group: int | None  # the shared prefix it starts with


@dataclass
class RequestRecord:
    """What one request did: one line of the JSONL file. Times are seconds."""

    index: int
    group: int | None
    input_len: int
    output_len: int
    success: bool = False
    error: str | None = None
    prompt_tokens: int | None = None  # the server's usage counts
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    sent_at_s: float | None = None  # from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # text chunks, from sending
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    itl_s: list[float] = field(default_factory=list)  # per token, one per later chunk


@dataclass(frozen=True)
class TokenCalibration:
    """Tokens of a prompt of ``w`` random words: about ``extra_tokens + tokens_per_word * w``."""

    tokens_per_word: float
    extra_tokens: float

    def words_for(self, tokens: float) -> int:
        """How many words make about ``tokens`` tokens (not counting the extra ones)."""
        return max(1, round(tokens / self.tokens_per_word))


@dataclass(frozen=True)
class ServerInfo:
    """What the harness learns from the server before the run."""

    model: str
    max_model_len: int | None
    stream_interval: int
    #: Every model name asked for, in turn (``model`` is the first).
    models: tuple[str, ...] = ()

    def model_of(self, prompt: Prompt) -> str:
        """The model name ``prompt``'s request asks for."""
        return self.models[prompt.index % len(self.models)] if self.models else self.model


# --------------------------------------------------------------------------- the workload


def sample_lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    """``n`` lengths uniform in ``[ratio * length, length]``, at least 1."""
    low = max(1, math.ceil(ratio * length))
    return [rng.randint(min(low, length), length) for _ in range(n)]


def random_words(rng: random.Random, n: int) -> str:
    """``n`` random words joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_prompts(settings: ServingBenchSettings, calibration: TokenCalibration,
                  ) -> list[Prompt]:
    """The run's prompts; the same for the same seed and server tokenizer.

    With shared prefixes, prompt ``i`` is prefix ``i % G`` followed by its own
    ``--input-len``-long part, so its target length is the sum of both.
    """
    rng = random.Random(settings.seed)
    n = settings.num_prompts
    inputs = sample_lengths(rng, n, settings.input_len, settings.range_ratio)
    outputs = sample_lengths(rng, n, settings.output_len, settings.range_ratio)
    groups = settings.shared_prefix_groups
    prefix_words = calibration.words_for(settings.shared_prefix_len) if groups else 0
    prefixes = [random_words(rng, prefix_words) + " " for _ in range(groups)]
    prompts = []
    for i in range(n):
        group = i % groups if groups else None
        target = inputs[i] + settings.shared_prefix_len
        own_words = calibration.words_for(target - calibration.extra_tokens) - prefix_words
        text = (prefixes[i % groups] if groups else "") + random_words(rng, max(1, own_words))
        prompts.append(Prompt(i, text, target, outputs[i], group))
    return prompts


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times from the start of the run: a Poisson process of ``rate`` per second.

    Their own generator keeps the prompts the same whatever the rate.
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}")
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


# --------------------------------------------------------------------------- the math


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100), interpolated linearly between ranks as numpy does."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def describe(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """Mean and percentiles of ``values`` times ``scale`` (seconds to ms); None when empty."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    stats = [sum(values) / len(values)] + [percentile(values, q) for q in PERCENTILES]
    return {k: v * scale for k, v in zip(keys, stats)}


def chunk_token_counts(chunks: int, tokens: int, interval: int) -> list[int]:
    """Tokens carried by each of ``chunks`` text chunks of a ``tokens``-token completion.

    A server streaming every ``interval`` tokens sends either the first token alone and
    then ``interval`` tokens a chunk (this project, SGLang), or ``interval`` tokens from
    the start; the last chunk carries the rest. The first pattern that adds up is taken;
    when neither does (a chunk held back, a server streaming otherwise), the tokens are
    spread evenly.
    """
    if chunks <= 0:
        return []
    if chunks == 1:
        return [tokens]
    last = tokens - 1 - interval * (chunks - 2)
    if 1 <= last <= interval:
        return [1] + [interval] * (chunks - 2) + [last]
    last = tokens - interval * (chunks - 1)
    if 1 <= last <= interval:
        return [interval] * (chunks - 1) + [last]
    base, extra = divmod(max(tokens, chunks), chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def finish_record(record: RequestRecord, interval: int) -> None:
    """Derive TTFT, TPOT and ITL from the chunk times, or say why the request failed."""
    if record.error is None:
        if record.completion_tokens is None:
            record.error = "no usage in the stream (stream_options.include_usage unsupported?)"
        elif not record.chunk_times_s:
            record.error = "the stream carried no text"
        elif record.e2e_s is None:
            record.error = "the stream ended without data: [DONE]"
    record.success = record.error is None
    if not record.success:
        return
    assert record.completion_tokens is not None and record.e2e_s is not None
    times = record.chunk_times_s
    record.ttft_s = times[0]
    if record.completion_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
    record.chunk_tokens = chunk_token_counts(len(times), record.completion_tokens, interval)
    record.itl_s = [(times[k] - times[k - 1]) / record.chunk_tokens[k]
                    for k in range(1, len(times))]


def itl_samples(records: Sequence[RequestRecord]) -> list[float]:
    """The ITL values of successful requests, each repeated for every token it stands for."""
    return [gap for r in records if r.success
            for gap, n in zip(r.itl_s, r.chunk_tokens[1:]) for _ in range(n)]


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency statistics (ms) of a run's records.

    Token counts and latencies come from the successful requests only; failed ones
    are counted, by error, never dropped. Each ITL value counts once per token it
    stands for, so the ITL statistics are per token.
    """
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.completion_tokens or 0 for r in done)
    cached_tokens = sum(r.cached_tokens or 0 for r in done)
    itl = itl_samples(done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(Counter(r.error for r in records if not r.success)),
        "short_outputs": sum(r.completion_tokens != r.output_len for r in done),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "target_input_tokens": sum(r.input_len for r in done),
        "target_output_tokens": sum(r.output_len for r in done),
        "cached_tokens": cached_tokens,
        # The share of prompt tokens the server's prefix cache already held.
        "cache_hit_rate": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(done) * per_second,
        "input_throughput": input_tokens * per_second,
        "output_throughput": output_tokens * per_second,
        "total_token_throughput": (input_tokens + output_tokens) * per_second,
        "ttft_ms": describe([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_ms": describe(itl),
        "tpot_ms": describe([r.tpot_s for r in done if r.tpot_s is not None]),
        "e2e_ms": describe([r.e2e_s for r in done if r.e2e_s is not None]),
    }


# --------------------------------------------------------------------------- the server


def make_client(settings: ServingBenchSettings) -> httpx.AsyncClient:
    """A client bound to the base URL: no proxy from the environment, no connection cap."""
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.AsyncClient(
        base_url=settings.root_url, headers=headers, trust_env=False,
        timeout=httpx.Timeout(settings.request_timeout),
        # httpx caps a pool at 100 connections by default, which would cap the concurrency.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def _get_json(client: httpx.AsyncClient, path: str, timeout: float) -> Any:
    try:
        response = await client.get(path, timeout=timeout)
    except httpx.TimeoutException:
        raise TimeoutError(f"{client.base_url}{path} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach {client.base_url}{path}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"GET {path} answered HTTP {response.status_code}: "
                         f"{response.text[:200]}")
    return response.json()


async def probe_server(client: httpx.AsyncClient, settings: ServingBenchSettings) -> ServerInfo:
    """The model to ask for, its context length and the server's stream interval."""
    timeout = min(settings.request_timeout, _PROBE_TIMEOUT)
    listing = await _get_json(client, "/v1/models", timeout)
    models = [m for m in (listing.get("data") if isinstance(listing, dict) else None) or []
              if isinstance(m, dict) and "id" in m]
    if settings.model is None and not models:
        raise ValueError(f"{client.base_url}/v1/models lists no model; name one with --model")
    names = tuple(settings.model.split(",")) if settings.model else (models[0]["id"],)
    model = names[0]
    entry = next((m for m in models if m.get("id") == model), {})
    interval = settings.stream_interval
    if interval is None:
        # Ours and SGLang's report it; for any other server one token per chunk is assumed.
        try:
            info = await _get_json(client, "/get_server_info", timeout)
            interval = int(info.get("stream_interval") or 1)
        except (OSError, ValueError, AttributeError):
            interval = 1
    return ServerInfo(model, entry.get("max_model_len"), interval, names)


async def _prompt_tokens(client: httpx.AsyncClient, model: str, text: str,
                         timeout: float) -> int:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    try:
        response = await client.post("/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"calibration request failed: {exc!r}") from None
    if response.status_code != 200:
        raise ValueError(f"calibration request failed: HTTP {response.status_code}: "
                         f"{_error_message(response.text)}")
    try:
        return int(response.json()["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"calibration: the answer has no usage.prompt_tokens ({exc!r})") from None


async def calibrate(client: httpx.AsyncClient, settings: ServingBenchSettings,
                    server: ServerInfo) -> TokenCalibration:
    """Tokens per word and per prompt of the server's tokenizer, from a few 1-token requests.

    A text sent once and then twice in a row tells the tokens the server adds to
    every prompt (twice the first count minus the second); the mean over a few
    texts of ``n`` words tells the tokens per word. The requests also warm the
    server up before anything is timed.
    """
    rng = random.Random(f"calibration:{settings.seed}")
    timeout = min(settings.request_timeout, _PROBE_TIMEOUT)

    async def tokens(text: str) -> int:
        return await _prompt_tokens(client, server.model, text, timeout)

    rough = max(await tokens(random_words(rng, _SMALL_PROBE_WORDS)) / _SMALL_PROBE_WORDS, 0.25)
    # The doubled text fills about half the context, so that it fits any model.
    n = max(_SMALL_PROBE_WORDS, min(_LARGE_PROBE_WORDS,
                                    int(0.25 * (server.max_model_len or 4096) / rough)))
    texts = [random_words(rng, n) for _ in range(_PROBE_TEXTS)]
    counts = [await tokens(text) for text in texts]
    extra = 2 * counts[0] - await tokens(f"{texts[0]} {texts[0]}")
    per_word = (sum(counts) / len(counts) - extra) / n
    if per_word <= 0:
        raise ValueError(f"cannot calibrate prompt lengths: texts of {n} words made {counts} "
                         f"tokens, {extra} of them added by the server")
    return TokenCalibration(per_word, extra)


# --------------------------------------------------------------------------- the run


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], record: RequestRecord,
                  start: float) -> None:
    """Send one streaming request and fill ``record`` as its events arrive."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {_error_message(text)}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()  # before decoding, so the client's parsing is not counted
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                record.e2e_s = now - start
                return
            event = msgspec.json.decode(data)
            if "error" in event:
                record.error = f"error event: {_error_message(data)}"
                return
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens", 0)
            if any(choice.get("text") for choice in event.get("choices") or []):
                record.chunk_times_s.append(now - start)


def _error_message(text: str) -> str:
    """The ``message`` of an OpenAI-style error body, else the text's start."""
    try:
        body = json.loads(text)
        message = body.get("message") or body["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text
    return str(message)[:200]


async def send_request(client: httpx.AsyncClient, prompt: Prompt, server: ServerInfo,
                       settings: ServingBenchSettings, record: RequestRecord,
                       run_start: float) -> None:
    """One request, bounded by ``--request-timeout``; every failure ends in ``record.error``."""
    body = {
        "model": server.model_of(prompt), "prompt": prompt.text, "max_tokens": prompt.output_len,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    record.sent_at_s = start - run_start
    try:
        await asyncio.wait_for(_stream(client, body, record, start), settings.request_timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {settings.request_timeout:g} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (msgspec.DecodeError, AttributeError) as exc:
        record.error = f"unreadable stream event: {exc}"
    finish_record(record, server.stream_interval)


@dataclass
class RunOutcome:
    """The records of a run and how it went."""

    records: list[RequestRecord]
    duration_s: float
    max_in_flight: int
    hit_run_limit: bool


async def run_requests(client: httpx.AsyncClient, prompts: Sequence[Prompt],
                       server: ServerInfo, settings: ServingBenchSettings) -> RunOutcome:
    """Send every prompt on its arrival time, at most ``max_concurrency`` in flight."""
    from tqdm import tqdm

    records = [RequestRecord(p.index, p.group, p.input_len, p.output_len) for p in prompts]
    offsets = arrival_offsets(len(prompts), settings.request_rate, settings.seed)
    limit = (asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency
             else contextlib.nullcontext())
    tasks: list[asyncio.Task[None]] = []
    in_flight = peak = 0
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not settings.progress,
               file=sys.stderr)
    run_start = time.perf_counter()

    async def one(prompt: Prompt, record: RequestRecord) -> None:
        nonlocal in_flight, peak
        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await send_request(client, prompt, server, settings, record, run_start)
            finally:
                in_flight -= 1
                bar.update(1)

    async def dispatch() -> None:
        for prompt, record, offset in zip(prompts, records, offsets):
            # Absolute send times, so that a late wake-up does not delay every later request.
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt, record)))
        await asyncio.gather(*tasks)

    hit_limit = False
    try:
        await asyncio.wait_for(dispatch(), settings.max_duration)
    except asyncio.TimeoutError:
        hit_limit = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        bar.close()
    duration = time.perf_counter() - run_start
    for record in records:
        if not record.success and record.error is None:
            sent = "cancelled" if record.sent_at_s is not None else "not sent"
            record.error = f"{sent}: the run limit of {settings.max_duration:g} s was reached"
    return RunOutcome(records, duration, peak, hit_limit)


async def scheduler_seconds(client: httpx.AsyncClient, timeout: float
                            ) -> tuple[float, float] | None:
    """This project's Scheduler step and model-forward seconds so far; None elsewhere."""
    try:
        info = (await _get_json(client, "/get_server_info", timeout)).get("scheduler") or {}
        return float(info["step_seconds"]), float(info["forward_seconds"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def step_split(before: tuple[float, float] | None, after: tuple[float, float] | None
               ) -> dict[str, float] | None:
    """The run's Scheduler step seconds, model seconds and non-model share, when known."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    step, forward = after[0] - before[0], after[1] - before[1]
    return {"step_s": step, "forward_s": forward, "non_model_fraction": 1 - forward / step}


async def _run(settings: ServingBenchSettings) -> tuple[RunOutcome, dict[str, Any]]:
    async with make_client(settings) as client:
        server = await probe_server(client, settings)
        calibration = await calibrate(client, settings, server)
        prompts = build_prompts(settings, calibration)
        longest = max(p.input_len + p.output_len for p in prompts)
        if server.max_model_len is not None and longest > server.max_model_len:
            raise ValueError(f"a prompt and its output need up to {longest} tokens, more than "
                             f"the model's context length {server.max_model_len}")
        timeout = min(settings.request_timeout, _PROBE_TIMEOUT)
        before = await scheduler_seconds(client, timeout)
        outcome = await run_requests(client, prompts, server, settings)
        after = await scheduler_seconds(client, timeout)
    context = {
        "scheduler_time": step_split(before, after),
        "base_url": settings.root_url, "model": ",".join(server.models) or server.model,
        "stream_interval": server.stream_interval,
        "calibration": asdict(calibration), "max_in_flight": outcome.max_in_flight,
        "hit_run_limit": outcome.hit_run_limit,
    }
    return outcome, context


def run_benchmark(settings: ServingBenchSettings) -> tuple[dict[str, Any], list[Path]]:
    """Run the load, print the summary and write the result files; returns both."""
    settings.validate()
    started = datetime.datetime.now(datetime.timezone.utc)
    outcome, context = asyncio.run(_run(settings))
    summary = {
        **context, **summarize(outcome.records, outcome.duration_s),
        "started_at": f"{started:%Y-%m-%d %H:%M:%S} UTC", "machine": machine_description(),
        "python": platform.python_version(), "commit": git_commit(),
        "settings": {k: v for k, v in asdict(settings).items() if k != "api_key"},
    }
    print(format_summary(summary), flush=True)
    return summary, write_results(outcome.records, summary, settings)


# --------------------------------------------------------------------------- the output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _latency_rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, float | None]]]:
    return [(name.upper(), summary[f"{name}_ms"]) for name in LATENCY_METRICS]


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as printed at the end of a run."""
    s = summary
    lines = [
        f"requests: {s['completed']} completed, {s['failed']} failed, of {s['requests']} "
        f"in {s['duration_s']:.2f} s (at most {s['max_in_flight']} in flight)",
        f"tokens: {s['input_tokens']} input (target {s['target_input_tokens']}), "
        f"{s['output_tokens']} output (target {s['target_output_tokens']}), "
        f"{s['cached_tokens']} cached (cache hit rate {s['cache_hit_rate']:.1%})",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['input_throughput']:.1f} input "
        f"tok/s, {s['output_throughput']:.1f} output tok/s",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, stats in _latency_rows(s):
        lines.append(f"{name:<6}" + "".join(f"{_ms(stats[k]):>10}"
                                            for k in ("mean", "p50", "p90", "p99")))
    lines += [f"error ({count}x): {error}" for error, count in s["errors"].items()]
    if s["scheduler_time"]:
        split = s["scheduler_time"]
        lines.append(f"scheduler: {split['step_s']:.3f} s of steps, {split['forward_s']:.3f} s "
                     f"in the model; non-model time {split['non_model_fraction']:.1%}")
    if s["short_outputs"]:
        lines.append(f"note: {s['short_outputs']} requests returned another number of tokens "
                     "than they asked for")
    if s["hit_run_limit"]:
        lines.append(f"note: the run limit of {s['settings']['max_duration']:g} s was reached")
    return "\n".join(lines)


def _lengths(length: int, ratio: float) -> str:
    low = max(1, math.ceil(ratio * length))
    return str(length) if low >= length else f"{low}-{length}"


def render_markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown, headed by the machine, the commit and the settings."""
    s, cfg = summary, summary["settings"]
    arrival = ("all at once" if math.isinf(cfg["request_rate"])
               else f"Poisson, {cfg['request_rate']:g} req/s")
    if cfg["max_concurrency"]:
        arrival += f", at most {cfg['max_concurrency']} in flight"
    prefix = (f", after one of {cfg['shared_prefix_groups']} shared prefixes of "
              f"{cfg['shared_prefix_len']} tokens" if cfg["shared_prefix_groups"] else "")
    lines = [
        "# Serving benchmark",
        "",
        f"- Client machine: {s['machine']}",
        f"- Python {s['python']}, commit {s['commit']}",
        f"- Run: {s['started_at']}",
        f"- Server: {s['base_url']}, model {s['model']}, stream interval {s['stream_interval']}",
        f"- Workload: {cfg['num_prompts']} prompts (seed {cfg['seed']}) of "
        f"{_lengths(cfg['input_len'], cfg['range_ratio'])} tokens{prefix}, "
        f"{_lengths(cfg['output_len'], cfg['range_ratio'])} output tokens each (ignore_eos); "
        f"arrivals {arrival}",
        f"- Prompts: random words, {s['calibration']['tokens_per_word']:.3f} tokens per word "
        f"(calibrated); the server counted {s['input_tokens']:,} prompt tokens for a target "
        f"of {s['target_input_tokens']:,}",
        "",
        f"{s['completed']} of {s['requests']} requests completed in {s['duration_s']:.2f} s "
        f"({s['failed']} failed).",
        "",
        "| throughput | per second |",
        "|---|---:|",
        f"| requests | {s['request_throughput']:,.2f} |",
        f"| input tokens | {s['input_throughput']:,.1f} |",
        f"| output tokens | {s['output_throughput']:,.1f} |",
        "",
        f"Prefix cache: {s['cached_tokens']:,} of {s['input_tokens']:,} prompt tokens cached "
        f"(hit rate {s['cache_hit_rate']:.1%}).",
        "",
        "| latency (ms) | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {name} | " + " | ".join(_ms(stats[k]) for k in ("mean", "p50", "p90", "p99"))
              + " |" for name, stats in _latency_rows(s)]
    if s["scheduler_time"]:
        split = s["scheduler_time"]
        lines += ["", f"Server's Scheduler during the run: {split['step_s']:.3f} s of steps, "
                      f"{split['forward_s']:.3f} s of them in the model forward (non-model "
                      f"time {split['non_model_fraction']:.1%} of step time)."]
    if s["errors"]:
        lines += ["", "| error | requests |", "|---|---:|"]
        lines += [f"| {error} | {count} |" for error, count in s["errors"].items()]
    return "\n".join(lines) + "\n"


def write_results(records: Sequence[RequestRecord], summary: dict[str, Any],
                  settings: ServingBenchSettings) -> list[Path]:
    """``NAME.jsonl`` (one record per request), ``NAME.json``, ``NAME.md``, ``NAME.png``."""
    output_dir = Path(settings.output)
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / settings.run_name
    jsonl, summary_path, md = (stem.with_suffix(s) for s in (".jsonl", ".json", ".md"))
    with jsonl.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(asdict(record)) + "\n")
    # inf (an unbounded request rate) is not JSON; it is written as the string "inf".
    summary_path.write_text(json.dumps(_json_safe(summary), indent=2) + "\n", encoding="utf-8")
    md.write_text(render_markdown(summary), encoding="utf-8")
    written = [jsonl, summary_path, md]
    if settings.plot and write_plot(records, stem.with_suffix(".png")):
        written.append(stem.with_suffix(".png"))
    return written


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def write_plot(records: Sequence[RequestRecord], path: Path) -> bool:
    """Latency CDFs (TTFT, ITL, TPOT, E2E) of the successful requests; False without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"note: matplotlib is not installed, so {path.name} is not drawn "
              f"({PLOTS.install})", file=sys.stderr)
        return False
    done = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
        "ITL": itl_samples(done),
        "TPOT": [r.tpot_s for r in done if r.tpot_s is not None],
        "E2E": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    figure = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(figure)
    for axes, (name, values) in zip(figure.subplots(2, 2).flat, series.items()):
        ordered = sorted(v * 1000 for v in values)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.step(ordered, fractions, where="post")
        axes.set(title=name, xlabel="ms", ylim=(0, 1.02),
                 ylabel="fraction of tokens" if name == "ITL" else "fraction of requests")
        axes.grid(alpha=0.3)
    figure.suptitle(f"Latency CDFs, {len(done)} requests")
    figure.savefig(path, dpi=110)
    return True


# --------------------------------------------------------------------------- the command


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``framework bench serving`` flags."""
    parser.description = (
        "Send streaming /v1/completions requests to an OpenAI-compatible server and report "
        "TTFT, inter-token latency, TPOT, end-to-end latency and throughput. Exits 1 when a "
        "request failed.")
    d = ServingBenchSettings()
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=d.base_url, metavar="URL",
                        help=f"the server (default: {d.base_url}); a trailing /v1 is allowed")
    server.add_argument("--model", metavar="NAME",
                        help="model to ask for (default: the first of GET /v1/models); "
                        "several, comma-separated, are asked for in turn (e.g. LoRA adapters)")
    server.add_argument("--api-key", metavar="KEY", help="sent as a bearer token (not written)")
    server.add_argument("--stream-interval", type=int, metavar="N",
                        help="tokens per streamed chunk (default: the server's, from "
                        "/get_server_info, else 1)")
    load = parser.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=d.num_prompts, metavar="N",
                      help=f"requests to send (default: {d.num_prompts})")
    load.add_argument("--input-len", type=int, default=d.input_len, metavar="N",
                      help=f"prompt tokens, or each prompt's own part after a shared prefix "
                      f"(default: {d.input_len})")
    load.add_argument("--output-len", type=int, default=d.output_len, metavar="N",
                      help=f"output tokens, with ignore_eos (default: {d.output_len})")
    load.add_argument("--range-ratio", type=float, default=d.range_ratio, metavar="X",
                      help="lengths are uniform in [X * len, len] (default: 1, fixed lengths)")
    load.add_argument("--shared-prefix-groups", type=int, default=0, metavar="G",
                      help="each prompt starts with one of G fixed prefixes (default: none)")
    load.add_argument("--shared-prefix-len", type=int, default=0, metavar="L",
                      help="tokens of each shared prefix")
    load.add_argument("--seed", type=int, default=d.seed, metavar="N",
                      help=f"seed of the prompts and arrivals (default: {d.seed})")
    arrivals = parser.add_argument_group("arrivals and limits")
    arrivals.add_argument("--request-rate", type=float, default=d.request_rate, metavar="R",
                          help="Poisson arrivals of R requests/s; inf sends all at once "
                          "(default: inf)")
    arrivals.add_argument("--max-concurrency", type=int, metavar="C",
                          help="at most C requests in flight (default: no bound)")
    arrivals.add_argument("--request-timeout", type=float, default=d.request_timeout,
                          metavar="S", help=f"seconds one request may take "
                          f"(default: {d.request_timeout:g})")
    arrivals.add_argument("--max-duration", type=float, default=d.max_duration, metavar="S",
                          help=f"seconds the whole run may take; unfinished requests count "
                          f"as failed (default: {d.max_duration:g})")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default=d.output, metavar="DIR",
                     help=f"where the result files go (default: {d.output})")
    out.add_argument("--run-name", default=d.run_name, metavar="NAME",
                     help=f"stem of the result files (default: {d.run_name})")
    out.add_argument("--plot", action="store_true",
                     help="also draw NAME.png, latency CDFs (needs matplotlib)")
    out.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar")


def settings_from_cli(args: argparse.Namespace) -> ServingBenchSettings:
    """The settings named by the parsed flags."""
    names = {f for f in ServingBenchSettings.__dataclass_fields__}
    return ServingBenchSettings(**{k: v for k, v in vars(args).items() if k in names})


def run_from_cli(args: argparse.Namespace) -> int:
    """Entry point of ``framework bench serving``: 0 when every request succeeded, else 1."""
    summary, written = run_benchmark(settings_from_cli(args))
    for path in written:
        print(f"wrote {path}")
    return 0 if summary["failed"] == 0 else 1
