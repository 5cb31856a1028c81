"""Tests for the OpenAI-compatible HTTP API."""
