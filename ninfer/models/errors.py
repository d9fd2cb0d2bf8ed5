"""The one error every model loader raises (its own module, so loaders and the tokenizer share it)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model file or directory is missing, truncated, or of a kind ninfer cannot run.

    The message is one sentence that names the file and the problem; the CLI prints it as is.
    """
