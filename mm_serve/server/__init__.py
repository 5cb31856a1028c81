"""The whole HTTP service: the OpenAI API with the Batch API, and the server that drains on SIGTERM."""
