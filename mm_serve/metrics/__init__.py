"""Prometheus metrics of the service: per-request latencies and lifetime phases, per-worker
gauges, fault counters, and per-tier admission and attainment."""
