"""The offline API (:class:`~mm_serve.offline.llm.LLM`) and its results."""
