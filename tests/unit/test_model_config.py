"""``ModelConfig``: the model kind (embedding or generation) comes from the model class."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from framework.model_executor.model_config import ModelConfig
from framework.models import MODEL_ARCHITECTURES

SMALL = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 256}


class PooledEncoderForTest:
    """A plugin model class that says it returns pooled embeddings."""

    is_embedding_model = True


class DecoderWithoutKindForTest:
    """A plugin model class that says nothing of its kind (a generation model)."""


@pytest.fixture
def test_architectures() -> Iterator[None]:
    """The two test classes, registered as plugin architectures for one test."""
    classes = (PooledEncoderForTest, DecoderWithoutKindForTest)
    for cls in classes:
        MODEL_ARCHITECTURES.register(cls.__name__, cls, source="tests")
    yield
    for cls in classes:
        MODEL_ARCHITECTURES.unregister(cls.__name__)


def model_dir(tmp_path: Path, architecture: str) -> Path:
    """A directory whose config.json names ``architecture`` (ModelConfig reads no weights)."""
    directory = tmp_path / architecture
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**SMALL,
                                                       "architectures": [architecture]}))
    return directory


@pytest.mark.usefixtures("test_architectures")
def test_a_plugin_class_that_is_an_embedding_model_makes_an_embedding_config(
        tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir(tmp_path, "PooledEncoderForTest"))
    assert config.architecture == "PooledEncoderForTest"
    assert config.is_embedding and config.is_native_embedding


@pytest.mark.usefixtures("test_architectures")
def test_a_plugin_class_without_the_attribute_generates(tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir(tmp_path, "DecoderWithoutKindForTest"))
    assert not config.is_embedding and not config.is_native_embedding


def test_is_embedding_pools_a_generation_model_that_does_not_pool_itself(
        tmp_path: Path) -> None:
    config = ModelConfig.from_pretrained(model_dir(tmp_path, "LlamaForCausalLM"),
                                         is_embedding=True)
    assert config.is_embedding and not config.is_native_embedding


def test_the_built_in_classes_declare_their_kind() -> None:
    from framework.models.bert import BertModel
    from framework.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

    assert BertModel.is_embedding_model
    assert not LlamaForCausalLM.is_embedding_model and not Qwen3ForCausalLM.is_embedding_model
