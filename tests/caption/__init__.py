"""Tests of ``mm-serve caption``: inputs, resume, runner, backends, CLI."""
