"""Tests for vision_prefill."""
