"""Errors the planner raises for bad user input; the CLI turns each into one line, exit 2."""

from __future__ import annotations


class PlannerError(ValueError):
    """Base of the planner's user-facing errors; the message names the bad input."""


class ModelShapeError(PlannerError):
    """A config.json is missing, not JSON, or lacks a field the planner needs."""


class HardwareError(PlannerError):
    """An unknown hardware name."""


class ProfileError(PlannerError):
    """A measured-profile JSON file is missing, malformed or cannot be fitted."""
