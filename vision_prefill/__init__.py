"""Prefill domain of mm-serve: image preprocessing, vision encoder, projector, prefill worker."""
