"""Decode user-supplied images (raw bytes, data URIs, files) into upright RGB Pillow images.

Untrusted bytes go through :func:`load_image_bytes`, which enforces three rules:

1. only the formats in :data:`SUPPORTED_FORMATS` are identified (no exotic decoders);
2. the size declared by the header is checked against ``max_pixels`` before any
   pixel is decoded, so a decompression bomb costs a header parse, not gigabytes;
3. the pixels are fully decoded, so a truncated or corrupt file fails here with
   :class:`ImageDecodeError` instead of later inside the preprocessor.

Pillow's own bomb guard (``PIL.Image.MAX_IMAGE_PIXELS``, read but never changed
here) can refuse an image earlier than ``max_pixels`` would; both refusals become
:class:`ImageTooLargeError`. Truncated files are refused unless some other code has
set ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mm_serve.media.errors import (
    ImageDecodeError,
    ImageTooLargeError,
    InvalidImageURLError,
)
from mm_serve.media.local_file import read_media_file

SUPPORTED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""Pillow format names that :func:`load_image_bytes` will open ("JPEG" includes MPO)."""

_EXIF_ORIENTATION_TAG = 0x0112
_CORRUPT_MESSAGE = "image data is truncated or corrupt"


def to_rgb(image: Image.Image) -> Image.Image:
    """Return ``image`` as an upright 8-bit RGB image.

    Steps, in order:

    * the first frame is selected (animated GIF/WebP, multi-page TIFF);
    * the EXIF orientation tag (2-8) is applied with ``ImageOps.exif_transpose``;
    * high-bit-depth modes are scaled to 8 bits: ``I;16*`` linearly over the full
      16-bit range (``round(v / 257)``); ``I`` (int32) and ``F`` (float32) are
      min-max stretched over their finite values to 0-255 (NaN becomes 0, +/-inf
      clip to the ends; a constant image keeps its value clipped to 0-255);
    * any alpha (``LA``, ``La``, ``PA``, ``RGBA``, ``RGBa``, or a ``transparency``
      entry as in ``P`` / ``L`` / ``RGB`` PNGs and GIFs) is composited onto white;
    * everything else (``1``, ``L``, ``P``, ``CMYK``, ``YCbCr``, ``HSV``, ...) uses
      Pillow's conversion to RGB.

    Args:
        image: any Pillow image; it should already be loaded. Seeking to frame 0
            may change the current frame of ``image``.

    Returns:
        An RGB image of the upright size. When ``image`` is already an upright RGB
        image without transparency, ``image`` itself is returned (no copy).

    Raises:
        ImageDecodeError: the mode has no conversion to RGB.
    """
    if image.tell() != 0:
        image.seek(0)
    image = _apply_exif_orientation(image)
    if image.mode.startswith("I;16"):
        image = _sixteen_bit_to_l(image)
    elif image.mode in ("I", "F"):
        image = _stretch_to_l(image)
    bands = image.getbands()
    if "A" in bands or "a" in bands or image.info.get("transparency") is not None:
        return _composite_on_white(image)
    if image.mode == "RGB":
        return image
    try:
        return image.convert("RGB")
    except ValueError as exc:
        raise ImageDecodeError(f"unsupported image mode {image.mode!r}") from exc


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    """Transpose by the EXIF orientation tag; a missing or unreadable tag means upright."""
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION_TAG, 1)
        if orientation in range(2, 9):
            return ImageOps.exif_transpose(image)
    except Exception:  # corrupt EXIF metadata must not make the pixels unusable
        pass
    return image


def _sixteen_bit_to_l(image: Image.Image) -> Image.Image:
    """Map a 16-bit greyscale image to 8 bits: ``round(v / 257)``, so 65535 -> 255."""
    values = np.asarray(image).astype(np.uint32)
    # (v + 128) // 257 == round(v / 257): v / 257 is never exactly k + 0.5.
    return Image.fromarray(((values + 128) // 257).astype(np.uint8))


def _stretch_to_l(image: Image.Image) -> Image.Image:
    """Min-max stretch an int32 (``I``) or float32 (``F``) image to 8-bit greyscale."""
    values = np.asarray(image)
    finite = values[np.isfinite(values)] if values.dtype.kind == "f" else values
    scaled = values.astype(np.float32)
    if finite.size and float(finite.max()) > float(finite.min()):
        low, high = float(finite.min()), float(finite.max())
        scaled -= np.float32(low)
        scaled *= np.float32(255.0 / (high - low))
    np.nan_to_num(scaled, copy=False, nan=0.0)
    np.clip(scaled, 0.0, 255.0, out=scaled)
    np.rint(scaled, out=scaled)
    return Image.fromarray(scaled.astype(np.uint8))


def _composite_on_white(image: Image.Image) -> Image.Image:
    """Composite an image with alpha (or a transparency entry) onto opaque white."""
    if image.mode == "La":  # Pillow has no direct La -> RGBA conversion
        image = image.convert("LA")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def load_image_bytes(data: bytes, *, max_pixels: int) -> Image.Image:
    """Decode an encoded image (png, jpeg, webp, gif first frame, bmp, tiff) to RGB.

    Args:
        data: the encoded file contents.
        max_pixels: the largest accepted ``width * height``, checked on the header
            before decoding. Pillow's bomb guard may refuse a smaller image first.

    Returns:
        An upright, fully decoded RGB image (see :func:`to_rgb`).

    Raises:
        ImageTooLargeError: the declared size exceeds ``max_pixels`` or Pillow's
            decompression-bomb limit.
        ImageDecodeError: the bytes are empty, not an image of a supported format,
            truncated or corrupt.
        ValueError: ``max_pixels`` is not positive (a caller bug, not an ImageError).
    """
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive number of pixels, got {max_pixels}")
    if not data:
        raise ImageDecodeError("image data is empty")
    # Turn Pillow's bomb warning into an exception so it can be refused like the error.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = _open_header(data, max_pixels)
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageTooLargeError(None, None, max_pixels) from exc
        except Exception as exc:  # Pillow decoders raise many types on bad data
            raise ImageDecodeError(_CORRUPT_MESSAGE) from exc
    return to_rgb(image)


def _open_header(data: bytes, max_pixels: int) -> Image.Image:
    """Identify the format and read the header only; refuse oversized images."""
    try:
        image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(None, None, max_pixels) from exc
    except UnidentifiedImageError as exc:
        formats = ", ".join(name.lower() for name in SUPPORTED_FORMATS)
        raise ImageDecodeError(f"data is not an image in a supported format ({formats})") from exc
    except Exception as exc:  # a header that some plugin accepted but could not parse
        raise ImageDecodeError(_CORRUPT_MESSAGE) from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLargeError(width, height, max_pixels)
    if width < 1 or height < 1:
        raise ImageDecodeError(f"image has an empty size {width}x{height}")
    return image


def decode_data_uri(uri: str, *, max_pixels: int) -> Image.Image:
    """Decode a ``data:image/<format>;base64,<payload>`` URI to an RGB image.

    The scheme and ``base64`` marker are case-insensitive; media-type parameters
    before ``;base64`` are ignored. Whitespace (such as line breaks) inside the
    payload is removed, then the payload is decoded strictly (standard alphabet,
    correct padding). The format is identified from the bytes, not from the media
    type, so ``data:image/png`` carrying a JPEG still decodes.

    Args:
        uri: the image URL as sent by the client.
        max_pixels: passed to :func:`load_image_bytes`.

    Returns:
        An upright, fully decoded RGB image.

    Raises:
        InvalidImageURLError: not a data URI, a non-image media type, not base64,
            an empty payload, or a payload that is not valid base64.
        ImageTooLargeError, ImageDecodeError: as :func:`load_image_bytes`.
    """
    payload = "".join(_data_uri_payload(uri).split())
    if not payload:
        raise InvalidImageURLError("data URI contains no image data")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidImageURLError("data URI payload is not valid base64") from exc
    return load_image_bytes(data, max_pixels=max_pixels)


def _data_uri_payload(uri: str) -> str:
    """The base64 payload of a ``data:image/<format>;base64,`` URI, as sent (whitespace kept).

    Raises:
        InvalidImageURLError: not a data URI, no ',', a non-image media type, or not base64.
    """
    text = uri.strip()
    if text[:5].lower() != "data:":
        raise InvalidImageURLError(
            "image URL must be a data URI of the form data:image/<format>;base64,<data>"
        )
    header, separator, payload = text[5:].partition(",")
    if not separator:
        raise InvalidImageURLError("data URI has no ',' between its header and its data")
    params = [part.strip().lower() for part in header.split(";")]
    media_type = params[0]
    if not media_type.startswith("image/") or media_type == "image/":
        shown = media_type[:64] or "(none)"
        raise InvalidImageURLError(f"data URI media type must be image/<format>, got {shown!r}")
    if len(params) < 2 or params[-1] != "base64":
        raise InvalidImageURLError(
            "data URI must be base64-encoded (data:image/<format>;base64,...)"
        )
    return payload


def declared_size(uri: str, head_chars: int = 88_000) -> tuple[int, int] | None:
    """(width, height) that a ``data:`` URI's image header declares, read from at most the first
    ``head_chars`` characters of its payload (88,000 base64 characters = 64 KiB, room for EXIF
    before a JPEG's frame header) without decoding any pixel; None for anything else (a URL, a
    malformed URI, an unidentified or oversized header): callers then assume the worst."""
    try:
        head = "".join(_data_uri_payload(uri)[:head_chars].split())
    except InvalidImageURLError:
        return None
    head = head[: len(head) - len(head) % 4]
    if not head:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(base64.b64decode(head)), formats=SUPPORTED_FORMATS)
        width, height = image.size
    except Exception:  # anything unreadable: unknown, the caller reserves the most
        return None
    return (width, height) if width > 0 and height > 0 else None


def load_image_file(path: str | os.PathLike[str], *, max_pixels: int) -> Image.Image:
    """Read a regular file of at most :data:`~mm_serve.media.local_file.MAX_MEDIA_FILE_BYTES` and decode it with
    :func:`load_image_bytes`.

    Raises:
        OSError: the file cannot be read, is not a regular file or is larger than that
            (:func:`~mm_serve.media.local_file.read_media_file`; not an ImageError).
        ImageTooLargeError, ImageDecodeError: as :func:`load_image_bytes`.
    """
    return load_image_bytes(read_media_file(path), max_pixels=max_pixels)
