"""Tests of the embedded shapes model: generator, targets, tokenizer, checkpoint."""
