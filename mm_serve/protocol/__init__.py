"""The OpenAI wire protocol: request and response bodies, the error body, ``service_tier``
values, and log-probability formats. Plain data and validation; no HTTP server, no engine."""
