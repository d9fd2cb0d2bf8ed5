"""A model ready to run: spec, stored weights, tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import attrs

from ninfer.models.chat_template import ChatTemplate
from ninfer.models.spec import ModelSpec
from ninfer.models.tokenizer import Tokenizer
from ninfer.models.weights import ModelWeights


@attrs.frozen(eq=False)
class LoadedModel:
    name: str  # public id, e.g. "SmolLM2-135M-Instruct"
    path: Path
    file_format: str  # "gguf" or "hf"
    spec: ModelSpec
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    stop_token_ids: tuple[int, ...]  # every end-of-turn / end-of-text id the model declares
