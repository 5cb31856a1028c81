"""Video decoding and sampling (PyAV): frames sampled as transformers' ``Qwen2VLVideoProcessor.sample_frames``
does, the limits checked before any frame is decoded, and every kind of bad data a ``VideoError``."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mm_serve.media.errors import ImageError
from mm_serve.media.video_loading import (
    Video,
    VideoError,
    VideoLimits,
    decode_video_data_uri,
    encode_video,
    load_video_bytes,
    sample_indices,
)
from tests.factories import gradient_video


def _clip(frames: int = 12, fps: float = 4, width: int = 64, height: int = 48, codec: str = "mpeg4",
          container_format: str = "mp4") -> bytes:
    return encode_video(gradient_video(frames, width, height, 1).frames, fps, codec, container_format)


def test_sample_indices_follow_transformers() -> None:
    """``floor(i * total / n)`` for ``n = min(max_frames, max(2, round(duration * fps)), total)`` frames, as
    ``Qwen2VLVideoProcessor.sample_frames`` picks them."""
    import torch

    assert sample_indices(30, 3.0, 2.0, 32) == [0, 5, 10, 15, 20, 25]
    assert sample_indices(30, 3.0, 2.0, 4) == [0, 7, 15, 22]
    assert sample_indices(3, 0.1, 2.0, 32) == [0, 1]  # never fewer than two where the video has them
    assert sample_indices(1, 0.5, 2.0, 32) == [0]
    for total, n in [(30, 6), (97, 13), (8, 8)]:
        ours = sample_indices(total, total / 10, n / (total / 10), 768)
        assert ours == torch.arange(0, total, total / n).int().tolist()


def test_an_mp4_is_sampled_at_the_requested_rate_and_cap() -> None:
    data = _clip(12, fps=4)  # 3 s
    video = load_video_bytes(data, VideoLimits(fps=2.0))
    assert video.frames.shape == (6, 48, 64, 3) and video.frames.dtype == np.uint8 and video.fps == pytest.approx(2.0)
    capped = load_video_bytes(data, VideoLimits(fps=4.0, max_frames=3))
    assert capped.num_frames == 3 and capped.fps == pytest.approx(1.0)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert np.array_equal(decode_video_data_uri(uri, VideoLimits(fps=2.0)).frames, video.frames)


def test_webm_and_animated_gif_are_videos() -> None:
    webm = load_video_bytes(_clip(8, fps=4, codec="libvpx", container_format="webm"), VideoLimits())
    assert webm.num_frames == 4
    frames = [Image.fromarray(f) for f in gradient_video(6, 40, 30, 2).frames]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    gif = load_video_bytes(buf.getvalue(), VideoLimits())
    assert gif.size == (30, 40) and 2 <= gif.num_frames <= 6


@pytest.mark.parametrize("limits, message", [
    (VideoLimits(max_seconds=2.0), "longer than the limit of 2 s"),
    (VideoLimits(max_frame_pixels=1000), "frames are too large: 64x48"),
    (VideoLimits(max_stream_frames=5), "more than 5 frames"),
])
def test_limits_are_checked_before_decoding(limits: VideoLimits, message: str) -> None:
    with pytest.raises(VideoError, match=message):
        load_video_bytes(_clip(12, fps=4), limits)


def test_bad_data_is_a_video_error() -> None:
    """Empty, garbage, truncated, a still image, a bad data URI: each a ``VideoError`` (an ``ImageError``,
    so the API answers 400) naming the problem, never an FFmpeg exception."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    clip = _clip(12)
    cases = [(b"", "empty"), (b"\x00garbage" * 50, "not a readable video"), (png.getvalue(), "still image"),
             (clip[: len(clip) // 4], "not a readable video|no decodable frame|no frame")]
    for data, message in cases:
        with pytest.raises(VideoError, match=message):
            load_video_bytes(data, VideoLimits())
    for uri, message in [("data:image/png;base64,AAAA", "data:video/"), ("data:video/mp4;base64,@@@", "base64"),
                         ("data:video/mp4,AAAA", "data:video/")]:
        with pytest.raises(VideoError, match=message):
            decode_video_data_uri(uri, VideoLimits())
    assert issubclass(VideoError, ImageError)


def test_a_video_checks_its_frames() -> None:
    with pytest.raises(VideoError, match="uint8"):
        Video(np.zeros((2, 4, 4, 3), dtype=np.float32), 2.0)
    with pytest.raises(VideoError, match="frame rate"):
        Video(np.zeros((2, 4, 4, 3), dtype=np.uint8), 0.0)
    with pytest.raises(ValueError, match="fps and max_seconds"):
        VideoLimits(fps=0)
