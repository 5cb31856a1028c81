"""Tests for mm_serve.media.image_loading: modes to RGB, formats, corrupt input, bombs, data URIs."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mm_serve.media.errors import (
    ImageDecodeError,
    ImageError,
    ImageTooLargeError,
    InvalidImageURLError,
)
from mm_serve.media.image_loading import (
    decode_data_uri,
    load_image_bytes,
    load_image_file,
    to_rgb,
)

MAX_PIXELS = 50_000_000
WHITE = (255, 255, 255)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def four_colour_image() -> Image.Image:
    """32x16 RGB: quadrants red, green, blue, white (left to right, top to bottom)."""
    pixels = np.zeros((16, 32, 3), dtype=np.uint8)
    pixels[:8, :16] = (255, 0, 0)
    pixels[:8, 16:] = (0, 255, 0)
    pixels[8:, :16] = (0, 0, 255)
    pixels[8:, 16:] = WHITE
    return Image.fromarray(pixels)


def pixel(image: Image.Image, x: int, y: int) -> tuple[int, ...]:
    """The RGB value at (x, y) as a tuple of ints."""
    return tuple(int(v) for v in np.asarray(image)[y, x])


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height but whose IDAT holds a few bytes."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def palette_image_with_transparency() -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 255])
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0  # palette index 0 (red) is transparent
    return image


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (Image.new("1", (2, 2), 1), WHITE),
        (Image.new("1", (2, 2), 0), (0, 0, 0)),
        (Image.new("L", (2, 2), 77), (77, 77, 77)),
        (Image.new("LA", (2, 2), (100, 0)), WHITE),
        (Image.new("LA", (2, 2), (100, 255)), (100, 100, 100)),
        (Image.new("La", (2, 2), (100, 255)), (100, 100, 100)),
        (Image.new("RGBA", (2, 2), (255, 0, 0, 0)), WHITE),
        (Image.new("RGBA", (2, 2), (10, 20, 30, 255)), (10, 20, 30)),
        (Image.new("RGBA", (2, 2), (255, 0, 0, 128)), (255, 127, 127)),
        (Image.new("CMYK", (2, 2), (255, 0, 0, 0)), (0, 255, 255)),
        (Image.new("CMYK", (2, 2), (0, 0, 0, 255)), (0, 0, 0)),
        (Image.new("I;16", (2, 2), 65535), WHITE),
        (Image.new("I;16", (2, 2), 128 * 257), (128, 128, 128)),
        (Image.new("I;16", (2, 2), 1000), (4, 4, 4)),
        (Image.new("YCbCr", (2, 2), (255, 128, 128)), WHITE),
    ],
    ids=lambda value: value.mode if isinstance(value, Image.Image) else "",
)
def test_to_rgb_gives_expected_colour(image: Image.Image, expected: tuple[int, int, int]) -> None:
    rgb = to_rgb(image)
    assert rgb.mode == "RGB"
    assert rgb.size == image.size
    np.testing.assert_allclose(np.asarray(rgb)[0, 0], expected, atol=1)


def test_palette_transparency_index_becomes_white() -> None:
    rgb = to_rgb(palette_image_with_transparency())
    assert pixel(rgb, 0, 0) == WHITE
    assert pixel(rgb, 1, 0) == (0, 0, 255)


def test_palette_transparency_survives_png_and_gif() -> None:
    for fmt in ("PNG", "GIF"):
        rgb = load_image_bytes(
            encode(palette_image_with_transparency(), fmt), max_pixels=MAX_PIXELS
        )
        assert (pixel(rgb, 0, 0), pixel(rgb, 1, 0)) == (WHITE, (0, 0, 255)), fmt


def test_int32_and_float_images_are_min_max_stretched() -> None:
    as_int = Image.fromarray(np.array([[0, 1000, 2000]], dtype=np.int32))
    as_float = Image.fromarray(np.array([[-1.0, 0.0, 1.0, np.nan]], dtype=np.float32))
    assert (as_int.mode, as_float.mode) == ("I", "F")
    assert np.asarray(to_rgb(as_int))[0, :, 0].tolist() == [0, 128, 255]
    assert np.asarray(to_rgb(as_float))[0, :, 0].tolist() == [0, 128, 255, 0]


def test_constant_wide_image_keeps_its_clipped_value() -> None:
    assert pixel(to_rgb(Image.new("I", (2, 2), 90)), 0, 0) == (90, 90, 90)
    assert pixel(to_rgb(Image.new("F", (2, 2), 1e6)), 0, 0) == WHITE


def test_upright_rgb_is_returned_without_a_copy() -> None:
    image = Image.new("RGB", (3, 3), (1, 2, 3))
    assert to_rgb(image) is image


def test_exif_orientation_6_rotates_clockwise() -> None:
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:, :20] = (255, 0, 0)  # left half red
    pixels[:, 20:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(pixels), "JPEG", exif=exif.tobytes(), quality=95)
    rgb = load_image_bytes(data, max_pixels=MAX_PIXELS)
    assert rgb.size == (20, 40)  # width and height swapped
    np.testing.assert_allclose(pixel(rgb, 10, 5), (255, 0, 0), atol=12)  # left is now top
    np.testing.assert_allclose(pixel(rgb, 10, 35), (0, 0, 255), atol=12)


def test_gif_gives_first_frame_even_after_seeking() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=10)
    assert pixel(load_image_bytes(data, max_pixels=MAX_PIXELS), 4, 4) == (255, 0, 0)
    opened = Image.open(io.BytesIO(data))
    opened.seek(1)
    assert pixel(to_rgb(opened), 4, 4) == (255, 0, 0)


@pytest.mark.parametrize(
    ("fmt", "params", "atol"),
    [
        ("PNG", {}, 0),
        ("BMP", {}, 0),
        ("TIFF", {}, 0),
        ("GIF", {}, 0),
        ("WEBP", {"lossless": True}, 0),
        ("WEBP", {"quality": 90}, 40),
        ("JPEG", {"quality": 95}, 40),
        ("MPO", {"quality": 95}, 40),  # multi-picture JPEG, as some cameras write
    ],
)
def test_format_round_trip(fmt: str, params: dict[str, object], atol: int) -> None:
    original = four_colour_image()
    rgb = load_image_bytes(encode(original, fmt, **params), max_pixels=MAX_PIXELS)
    assert (rgb.mode, rgb.size) == ("RGB", (32, 16))
    for xy in ((4, 4), (28, 4), (4, 12), (28, 12)):  # quadrant centres, away from edges
        np.testing.assert_allclose(pixel(rgb, *xy), pixel(original, *xy), atol=atol)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_raises_decode_error(fmt: str) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = encode(Image.fromarray(noise), fmt)
    with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
        load_image_bytes(data[: len(data) // 2], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize(
    "data",
    [
        np.random.default_rng(1).bytes(4096),
        b"",
        b"\x89PNG\r\n\x1a\n",
        encode(Image.new("RGB", (4, 4)), "PPM"),  # a real image, but not an accepted format
    ],
    ids=["random", "empty", "png-signature-only", "ppm"],
)
def test_non_image_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(ImageDecodeError):
        load_image_bytes(data, max_pixels=MAX_PIXELS)


def test_bomb_header_is_refused_quickly_without_decoding() -> None:
    limit_before = Image.MAX_IMAGE_PIXELS
    started = time.perf_counter()
    with pytest.raises(ImageTooLargeError, match="too large"):
        load_image_bytes(png_header_only(50_000, 50_000), max_pixels=MAX_PIXELS)
    assert time.perf_counter() - started < 1.0  # 7.5 GB of pixels were never allocated
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_size_over_max_pixels_is_refused_before_pixel_data_is_read() -> None:
    # The IDAT covers a few rows only: decoding would fail as truncated, so a
    # size error proves the refusal came from the header.
    with pytest.raises(ImageTooLargeError) as caught:
        load_image_bytes(png_header_only(3000, 2000), max_pixels=1_000_000)
    error = caught.value
    assert (error.width, error.height, error.max_pixels) == (3000, 2000, 1_000_000)
    assert "3000x2000" in str(caught.value)
    with pytest.raises(ImageDecodeError):  # the same bytes under a higher limit: decoded, truncated
        load_image_bytes(png_header_only(3000, 2000), max_pixels=10_000_000)
    at_limit = encode(Image.new("RGB", (100, 50)), "PNG")
    assert load_image_bytes(at_limit, max_pixels=5000).size == (100, 50)
    with pytest.raises(ImageTooLargeError):
        load_image_bytes(encode(Image.new("RGB", (100, 51)), "PNG"), max_pixels=5000)


def test_pillow_bomb_warning_becomes_too_large_error() -> None:
    with pytest.raises(ImageTooLargeError) as caught:  # 1e8 pixels > Pillow's 89.5M warning limit
        load_image_bytes(png_header_only(10_000, 10_000), max_pixels=10**9)
    assert caught.value.width is None


def test_max_pixels_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pixels") as caught:
        load_image_bytes(encode(Image.new("RGB", (1, 1)), "PNG"), max_pixels=0)
    assert not isinstance(caught.value, ImageError)


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_data_uri_decodes_each_format(fmt: str) -> None:
    image = Image.new("RGB", (16, 8), (0, 0, 255))
    uri = data_uri(encode(image, fmt), f"image/{fmt.lower()}")
    rgb = decode_data_uri(uri, max_pixels=MAX_PIXELS)
    assert rgb.size == (16, 8)
    np.testing.assert_allclose(pixel(rgb, 8, 4), (0, 0, 255), atol=8)


def test_data_uri_tolerates_line_breaks_case_and_parameters() -> None:
    payload = base64.encodebytes(encode(four_colour_image(), "PNG")).decode()  # 76-char lines
    assert "\n" in payload
    uri = f"  DATA:Image/PNG;name=x.png;BASE64,{payload}  "
    assert pixel(decode_data_uri(uri, max_pixels=MAX_PIXELS), 28, 12) == WHITE


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
        ("data:text/plain;base64,aGVsbG8=", "text/plain"),
        ("data:;base64,aGVsbG8=", "media type"),
        ("data:image/png,rawbytes", "base64-encoded"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,", "no image data"),
        ("https://example.com/cat.png", "data URI"),
    ],
)
def test_bad_data_uri_raises_invalid_url_error(uri: str, message: str) -> None:
    with pytest.raises(InvalidImageURLError, match=message):
        decode_data_uri(uri, max_pixels=MAX_PIXELS)


def test_data_uri_with_non_image_payload_raises_decode_error() -> None:
    with pytest.raises(ImageDecodeError, match="not an image"):
        decode_data_uri(data_uri(b"hello world, not a picture"), max_pixels=MAX_PIXELS)


def test_data_uri_bomb_raises_too_large_error() -> None:
    with pytest.raises(ImageTooLargeError):
        decode_data_uri(data_uri(png_header_only(50_000, 50_000)), max_pixels=MAX_PIXELS)


def test_load_image_file(tmp_path: Path) -> None:
    path = tmp_path / "quad.png"
    path.write_bytes(encode(four_colour_image(), "PNG"))
    assert pixel(load_image_file(path, max_pixels=MAX_PIXELS), 4, 12) == (0, 0, 255)
    with pytest.raises(FileNotFoundError):
        load_image_file(tmp_path / "missing.png", max_pixels=MAX_PIXELS)
