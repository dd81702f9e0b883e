"""The embedded default model: a tiny Llama that completes Python code.

``framework serve`` and ``framework.Engine()`` serve it when no model path is
given, so that the runtime works offline out of the box. The checkpoint lives
in this package directory in Hugging Face's layout (bfloat16 safetensors, a
byte-level BPE fast tokenizer) with its model card ``README.md``; it is made
by ``scripts/train_default_model.py``, whose card records the exact command,
the data (the Python standard library's sources) and the training run.

Example::

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from framework.default_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
"""

from __future__ import annotations

from pathlib import Path

# The files a usable default model directory must hold: the checkpoint, the tokenizer,
# and the model card with the loss history and curve it refers to.
DEFAULT_MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "loss_history.csv",
    "loss_curve.png",
)

TRAINING_COMMAND = "python scripts/train_default_model.py --output framework/default_model"


def missing_default_model_files() -> list[str]:
    """The names in ``DEFAULT_MODEL_FILES`` that this package directory lacks."""
    directory = Path(__file__).resolve().parent
    return [name for name in DEFAULT_MODEL_FILES if not (directory / name).is_file()]


def default_model_path() -> str:
    """The directory of the embedded default model (this package's directory).

    Raises ``FileNotFoundError`` naming the missing files when the checkpoint is
    incomplete (a source checkout where it was never trained, or a package built
    without its data files).
    """
    missing = missing_default_model_files()
    if missing:
        raise FileNotFoundError(
            f"the embedded default model is incomplete: {', '.join(missing)} missing from "
            f"{Path(__file__).resolve().parent}; train it with `{TRAINING_COMMAND}` "
            "or pass --model-path"
        )
    return str(Path(__file__).resolve().parent)


def default_draft_model_path() -> str:
    """The directory of the default model's draft model (``draft/``), for
    ``--speculative-algorithm draft``; made by ``scripts/train_default_model.py --teacher``.

    Raises ``FileNotFoundError`` when it is missing or incomplete.
    """
    directory = Path(__file__).resolve().parent / "draft"
    missing = [name for name in DEFAULT_MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the default model's draft is incomplete: {', '.join(missing)} "
                                f"missing from {directory}")
    return str(directory)
