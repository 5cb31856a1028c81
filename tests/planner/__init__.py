"""Tests of the placement planner, simulator and benchmark workloads."""
