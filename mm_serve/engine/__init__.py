"""The request client: submit a processed request, route it to ready workers, assemble the
token updates into its state (detokenized, stop strings cut), migrate it when a worker fails."""
