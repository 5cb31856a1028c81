"""The version of mm-serve (``mm_serve.__version__``, ``/version``, the app's OpenAPI document)."""

VERSION = "0.1.0"
