"""Realistic sample messages for the transport benchmark, built reproducibly from a seed.

Each sample is shaped like what a serving runtime really sends: request ids
are 32 hex characters (``uuid4().hex``), the handles that name requests in
per-step outputs are a TokenizerManager's counter (int64), counters sit in realistic ranges,
token ids lie in a Llama-3-sized vocabulary, and embeddings are unit-norm
float32 rows. The names are what ``framework bench transport --messages``
accepts.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable

import numpy as np

from framework.messages import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    Message,
    RequestConstants,
    TokenizedGenerateReqInput,
)
from framework.sampling_params import SamplingParams

VOCAB_SIZE = 128_256  # Llama 3's vocabulary: token ids need three bytes, as in real traffic
EOS_TOKEN_ID = 128_001
DEFAULT_SEED = 0

# A batch at least this large has one request finishing in it, as a busy decode step does.
_FINISHED_IN_BATCH_FROM = 64

_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "if so no will more can said who out up about into than them some could what time "
    "only new other these two may first then do any like my now over such our man me "
    "even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go "
    "came right used take three model token cache batch request server latency prompt"
)
_WORDS = tuple(_WORDS_TEXT.split())


def request_id(rng: random.Random) -> str:
    """A request id in the form real clients and servers use: ``uuid4().hex`` (32 hex chars)."""
    return uuid.UUID(int=rng.getrandbits(128), version=4).hex


def token_ids_batch(batch_size: int, seed: int = DEFAULT_SEED) -> BatchTokenIDOutput:
    """One decode step's output: one new token for each of ``batch_size`` running requests.

    From a batch of 64 on, one request finishes in the step and another sends
    its first output, with the constants a first output carries, as in a busy
    batch where a request joins for each one that leaves.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = random.Random(seed)
    # The running requests' handles: a counter's values, spread over recent requests.
    handles = sorted(rng.sample(range(1, 16 * batch_size + 1), batch_size))
    output_ids = [rng.randrange(VOCAB_SIZE) for _ in range(batch_size)]
    msg = BatchTokenIDOutput(
        handles=np.array(handles, dtype=np.int64),
        output_ids=np.array(output_ids, dtype=np.int32),
        # One new id each: no offsets (the Scheduler sends them only when counts differ).
        output_offsets=None,
        # A fixed stamp in place of the clock's, so that a sample is the same every time.
        created_at=0.0,
    )
    if batch_size >= _FINISHED_IN_BATCH_FROM:
        finished, new = rng.sample(range(batch_size), 2)
        msg.finished_indices = [finished]
        msg.finished_reasons = [FinishReason("stop", matched=EOS_TOKEN_ID)]
        msg.new_indices = [new]
        msg.new_constants = [first_output_constants(rng)]
    return msg


def first_output_constants(rng: random.Random) -> RequestConstants:
    """What a request's first output carries: a prompt of a few hundred tokens, partly cached."""
    prompt_tokens = rng.randrange(100, 1_000)
    return RequestConstants(
        stop_strs=["</s>", "\n\nUser:"],
        context_ids=[rng.randrange(VOCAB_SIZE) for _ in range(5)],
        prompt_tokens=prompt_tokens,
        # A shared system prompt hits the prefix cache; the rest of the prompt does not.
        cached_tokens=prompt_tokens - prompt_tokens % 64,
    )


def generate_request(prompt_tokens: int, seed: int = DEFAULT_SEED) -> TokenizedGenerateReqInput:
    """A tokenized generation request with a ``prompt_tokens``-token prompt and its text.

    The text has one word per token id, which gives it the length of a real
    prompt of that many tokens (about five characters a token).
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(prompt_tokens)]
    return TokenizedGenerateReqInput(
        rid=request_id(rng),
        handle=rng.randrange(1, 1 << 20),
        input_text=" ".join(words),
        input_ids=[rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens)],
        sampling_params=SamplingParams(
            max_new_tokens=512, temperature=0.7, top_p=0.9, stop=["</s>", "\n\nUser:"]
        ),
        stream=True,
    )


def embedding_batch(batch_size: int, dim: int, seed: int = DEFAULT_SEED) -> BatchEmbeddingOutput:
    """Embeddings of ``batch_size`` finished requests: one unit-norm float32 row of ``dim`` each."""
    if batch_size < 1 or dim < 1:
        raise ValueError(f"batch_size and dim must be >= 1, got {batch_size} and {dim}")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    rows = np_rng.standard_normal((batch_size, dim), dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return BatchEmbeddingOutput(
        rids=[request_id(rng) for _ in range(batch_size)],
        finished_reasons=[FinishReason("length") for _ in range(batch_size)],
        # One array per request, as the scheduler produces them; each may travel as its own frame.
        embeddings=np.ascontiguousarray(rows),
        prompt_tokens=[rng.randrange(8, 512) for _ in range(batch_size)],
    )


#: Every sample by the name ``--messages`` takes, in the order results are reported.
SAMPLE_MESSAGES: dict[str, Callable[[], Message]] = {
    "token_ids@1": lambda: token_ids_batch(1),
    "token_ids@64": lambda: token_ids_batch(64),
    "token_ids@256": lambda: token_ids_batch(256),
    "generate_req@8192": lambda: generate_request(8192),
    "embedding@256x1024": lambda: embedding_batch(256, 1024),
}

#: What each sample stands for, for ``--help`` and the docs.
SAMPLE_DESCRIPTIONS: dict[str, str] = {
    "token_ids@1": "BatchTokenIDOutput, batch 1, one new token",
    "token_ids@64": "BatchTokenIDOutput, batch 64, one new token each, one request finished",
    "token_ids@256": "BatchTokenIDOutput, batch 256, one new token each, one request finished",
    "generate_req@8192": "TokenizedGenerateReqInput, 8,192-token prompt with its text",
    "embedding@256x1024": "BatchEmbeddingOutput, 256 float32 rows of 1,024",
}


def build_sample(name: str) -> Message:
    """The sample message called ``name``; unknown names raise ``ValueError`` listing the known."""
    builder = SAMPLE_MESSAGES.get(name)
    if builder is None:
        raise ValueError(f"unknown message {name!r}; known: {', '.join(SAMPLE_MESSAGES)}")
    return builder()
