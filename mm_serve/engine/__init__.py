"""The front end's engine side: input processing, the worker pool and the request client,
the colocated engine and worker, the detokenizer, and the worker process entry point."""
