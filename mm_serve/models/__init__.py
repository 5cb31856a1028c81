"""Model definitions and checkpoint handling (llava-hf and Llama formats)."""
