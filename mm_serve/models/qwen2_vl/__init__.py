"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images (each its own patch grid) and M-RoPE positions."""
