"""Errors raised while loading and decoding user-supplied images.

Every error is an :class:`ImageError`, itself a :class:`ValueError`, so the API
layer can map the whole family to an HTTP 400 with ``str(exc)`` as the body.
Messages are written for the API user: they say what was wrong with the input
and never include the raw payload.
"""

from __future__ import annotations


class ImageError(ValueError):
    """Base class: the client sent an image that cannot be used (HTTP 400)."""


class ImageDecodeError(ImageError):
    """The bytes are not an image of a supported format, or are truncated or corrupt."""


class ImageTooLargeError(ImageError):
    """The image header declares more pixels than allowed (a possible decompression bomb).

    Raised before any pixel data is decoded.

    Attributes:
        width: width declared by the header, in pixels; None when Pillow's own
            decompression-bomb guard refused the image before the size was seen.
        height: height declared by the header, in pixels, or None as for width.
        max_pixels: the caller's limit on width * height, in pixels.
    """

    def __init__(self, width: int | None, height: int | None, max_pixels: int) -> None:
        self.width = width
        self.height = height
        self.max_pixels = max_pixels
        if width is not None and height is not None:
            detail = f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}"
        else:
            detail = "its declared size exceeds the decoder's pixel limit"
        super().__init__(f"image is too large: {detail} (refused as a possible decompression bomb)")


class InvalidImageURLError(ImageError):
    """An image URL is malformed: not a ``data:image/...;base64,`` URI, or bad base64."""
