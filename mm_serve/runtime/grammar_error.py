"""The error of a grammar that cannot be enforced (:mod:`mm_serve.runtime.structured_output`)."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar xgrammar cannot compile or would not enforce exactly (the message names the problem), or an
    unknown kind."""
