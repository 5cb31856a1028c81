"""The LLaVA-NeXT family (``LlavaNextForConditionalGeneration``, Liu et al. 2024, "LLaVA-NeXT:
Improved reasoning, OCR, and world knowledge"): any-resolution tiling over ``image_grid_pinpoints``,
the base image plus its tiles through the tower, the tiles' features unpadded to the image's aspect
ratio with an ``image_newline`` embedding after each row. transformers' own class is the reference."""
