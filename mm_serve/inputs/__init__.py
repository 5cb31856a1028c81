"""Input processing: chat templates, tokenizing, image-token expansion, the context check."""
