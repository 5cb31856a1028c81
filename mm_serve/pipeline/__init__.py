"""One call pipeline: an OpenAI request (chat or completions; from HTTP, a Batch API row or the
caption job) becomes an admitted generation: validate, resolve ``max_tokens`` once, load the
media once, check the context once, price it for admission, admit or refuse, submit
(:func:`~mm_serve.pipeline.pipeline.admit_call`). The routes, the batch rows and the caption job
are thin adapters on it."""
