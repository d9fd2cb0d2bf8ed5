"""Structured output: llguidance grammars as `TokenConstraint`s for the engine.

`GrammarCompiler` turns a JSON schema, "any JSON object", or a set of tools into a fresh
`GrammarConstraint` per request. The JSON-schema subset is llguidance's; anything it cannot
enforce raises `GrammarError`, which the server reports as a 400.
"""

from ninfer.grammar.constraint import GrammarCompiler, GrammarConstraint, GrammarError

__all__ = ["GrammarCompiler", "GrammarConstraint", "GrammarError"]
