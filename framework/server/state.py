"""``ServerState``: what every route handler needs, built once when the server starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from framework.config import ServerArgs
from framework.model_facts import ModelFacts
from framework.runtime.tokenizer_manager import TokenizerManager
from framework.server.openai_responses import now


@dataclass
class ServerState:
    """What the routes need: the runtime front and facts about the model."""

    tokenizer_manager: TokenizerManager
    server_args: ServerArgs
    model_name: str
    model_path: str
    #: The served model's facts, from the Scheduler's ready message.
    model: ModelFacts
    #: The model's ``created`` time in /v1/models: when the server started.
    created: int = dataclasses.field(default_factory=now)
