"""Model classes by Hugging Face architecture name (``config.architectures``).

Classes are registered as ``"module:Class"`` paths and imported on first use.
Third-party packages add architectures through the ``framework.models`` entry
point group. Every class follows one contract: ``cls(config, dtype, device,
**options)`` (``options`` among ``tp_rank``, ``tp_size``, ``model_dir``, as the
class accepts), ``forward(input_ids, positions, forward_batch)`` and
``load_weights(iterable of (name, tensor))``. A class whose ``load_weights``
reads its rank's part itself sets ``loads_checkpoint_slices = True``: it then
gets each tensor unread (``shape``, ``narrow``, ``[...]``; see
``framework.layers.linear.CheckpointWeight``), so that no rank reads a whole
tensor it holds a slice of. A class whose ``forward`` returns one pooled
embedding per sequence rather than logits sets ``is_embedding_model = True``:
its checkpoints are served as embedding models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from framework.registry import Registry

MODEL_ARCHITECTURES: Registry[Any] = Registry("model architecture", "framework.models")

for _name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    MODEL_ARCHITECTURES.register(_name, f"framework.models.llama:{_name}")
MODEL_ARCHITECTURES.register("BertModel", "framework.models.bert:BertModel")
for _name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
    MODEL_ARCHITECTURES.register(_name, f"framework.models.gemma:{_name}")
MODEL_ARCHITECTURES.register("Phi3ForCausalLM", "framework.models.phi3:Phi3ForCausalLM")
for _name in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
    MODEL_ARCHITECTURES.register(_name, f"framework.models.qwen_moe:{_name}")
MODEL_ARCHITECTURES.register("MixtralForCausalLM", "framework.models.mixtral:MixtralForCausalLM")


def supported_architectures() -> list[str]:
    """Every architecture name a model class is registered for, sorted."""
    return MODEL_ARCHITECTURES.names()


def resolve_architecture(architectures: Sequence[str] | None) -> str:
    """The first of a config's ``architectures`` that has a model class.

    Raises:
        ValueError: none of them is supported (the message lists the supported ones).
    """
    supported = supported_architectures()
    for name in architectures or ():
        if name in supported:
            return name
    if "Gemma3ForConditionalGeneration" in (architectures or ()):
        raise ValueError(
            "Gemma3ForConditionalGeneration (Gemma 3 with vision) is not supported: the text "
            "model Gemma3ForCausalLM is served, the vision parts are not"
        )
    raise ValueError(
        f"unsupported model architecture {list(architectures or [])}; "
        f"supported: {', '.join(supported)}"
    )


def get_model_class(architecture: str) -> Any:
    """The model class registered for ``architecture`` (imported now)."""
    return MODEL_ARCHITECTURES.get(resolve_architecture([architecture]))


def is_embedding_architecture(architecture: str) -> bool:
    """Whether the model class of ``architecture`` returns pooled embeddings (its
    ``is_embedding_model``; a class without the attribute generates). Imports the class."""
    return bool(getattr(get_model_class(architecture), "is_embedding_model", False))


__all__ = [
    "MODEL_ARCHITECTURES",
    "get_model_class",
    "is_embedding_architecture",
    "resolve_architecture",
    "supported_architectures",
]
