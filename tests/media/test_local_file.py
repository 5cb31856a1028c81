"""Local media files read whole, within a cap, only when regular (mm_serve/media/local_file.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from mm_serve.caption.backends import load_item_image, read_error_message
from mm_serve.caption.inputs import CaptionInput
from mm_serve.media.local_file import read_media_file
from tests.factories import gradient_image


def test_a_regular_file_is_read_whole_and_one_past_the_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"x" * 100)
    assert read_media_file(path, 100) == b"x" * 100
    with pytest.raises(OSError) as caught:
        read_media_file(path, 99)
    assert caught.value.errno == errno.EFBIG and caught.value.strerror == "larger than the 99-byte limit"
    assert caught.value.filename == str(path)  # named in the message, as open()'s own errors are


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """/dev/zero read whole grew a caption job until it was killed; a FIFO with no writer would block."""
    path = Path("/dev/zero") if kind == "device" else tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    with pytest.raises(OSError) as caught:
        read_media_file(path)
    assert caught.value.errno == errno.EINVAL and caught.value.strerror == "not a regular file"
    assert str(caught.value) == f"[Errno 22] not a regular file: '{path}'"


def test_a_symlink_is_refused_when_asked_and_followed_otherwise(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_media_file(tmp_path / "link") == b"abc"
    with pytest.raises(OSError) as caught:
        read_media_file(tmp_path / "link", follow_symlinks=False)
    assert caught.value.errno == errno.ELOOP


def test_a_caption_input_naming_a_device_is_an_error_row_not_a_read_without_end(tmp_path: Path) -> None:
    item = CaptionInput("z", "/dev/zero", "/dev/zero", "Describe.")
    with pytest.raises(OSError) as caught:
        load_item_image(item, 40_000_000)
    assert read_error_message(item, caught.value) == "cannot read image file /dev/zero: not a regular file"
    image = tmp_path / "ok.png"
    gradient_image(20, 10, 1).save(image)
    assert load_item_image(CaptionInput("ok", str(image), str(image), "Describe."), 40_000_000).size == (20, 10)
