"""The embedded default model: a small LLaVA trained here on shapes that Pillow draws.

``python -m mm_serve.shapes train --out DIR`` trains it from scratch;
``python -m mm_serve.shapes eval`` scores it on held-out scenes. The shipped
checkpoint lives in ``mm_serve/models/embedded``; the name ``embedded`` (and no
model at all) resolves to it through :func:`mm_serve.models.named_models.resolve_model`.

Modules: ``scenes`` (Pillow generator), ``targets`` (captions, questions,
answers), ``tokenizer`` (byte-level BPE + chat template), ``model_config``
(``LlavaConfig`` and preprocessing), ``dataset`` (training batches), ``train``,
``evaluate``. Importing this package is cheap (no torch, no transformers).
"""
