"""The browser console served by the API process: ``/playground`` (talk to the model: images, streaming,
per-reply latency) and ``/dashboard`` (SLO attainment, latency percentiles, refusals, workers, caches and
where each recent request's time went), offline and self-contained (docs/console.md)."""
