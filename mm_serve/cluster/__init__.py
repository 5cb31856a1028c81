"""The worker processes of one service instance: specs from the config, the worker pool
(spawn, readiness, supervision, restarts, rings and sockets), local processes or Ray actors,
and the worker process entry point."""
