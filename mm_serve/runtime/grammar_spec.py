"""What a structured-output grammar is on the wire, and its error (:mod:`mm_serve.runtime.structured_output`)."""

from __future__ import annotations

GrammarSpec = tuple[str, str]  # (kind, text): kinds in GRAMMAR_KINDS
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""``json``: a JSON schema's text; ``json_object``: any JSON object (text ""); ``regex``: a regular
expression; ``choice``: a JSON list of strings; ``grammar``: an EBNF grammar in xgrammar's dialect (GBNF,
``root ::= ...``)."""


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile or would not enforce exactly (the message names the problem), or an
    unknown kind."""


class GrammarAllowsNothing(GrammarError):
    """A grammar that compiles but with which no output can start: it allows no first token and is not
    complete when empty."""
