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


def test_sample_indices_are_transformers_own() -> None:
    """The frames kept are those ``Qwen2VLVideoProcessor.sample_frames`` picks with ``fps`` (at least 4, whole
    temporal patches, at most ``max_frames`` and the video's), over videos of every length and rate."""
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen2VLVideoProcessor()
    for total in (2, 3, 5, 8, 30, 97, 240, 1000):
        for seconds in (0.25, 1.0, 3.7, 12.0, 60.0):
            for fps, most in ((2.0, 32), (1.0, 768), (4.0, 6), (0.5, 32), (8.0, 3)):
                rate = total / seconds
                metadata = VideoMetadata(total_num_frames=total, fps=rate, duration=seconds)
                theirs = processor.sample_frames(metadata, fps=fps, max_frames=most).tolist()
                assert sample_indices(total, rate, fps, most) == theirs, (total, seconds, fps, most)
    assert sample_indices(1, 2.0, 2.0, 32) == [0]  # one frame: kept (their sampler finds no whole patch)


def test_an_mp4_is_sampled_at_the_requested_rate_and_cap() -> None:
    data = _clip(12, fps=4)  # 3 s
    video = load_video_bytes(data, VideoLimits(fps=2.0))
    assert video.frames.shape == (6, 48, 64, 3) and video.frames.dtype == np.uint8 and video.fps == pytest.approx(2.0)
    capped = load_video_bytes(data, VideoLimits(fps=4.0, max_frames=5))  # whole temporal patches: 4
    assert capped.num_frames == 4 and capped.fps == pytest.approx(4 / 12 * 4)
    short = load_video_bytes(_clip(3, fps=4), VideoLimits(fps=2.0))  # 0.75 s: at least 4 frames, but it has 3
    assert short.num_frames == 2
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


def test_a_raw_stream_without_timestamps_is_counted_at_its_rate() -> None:
    """A raw H.264 elementary stream (no container, no packet times): its packets are counted at the stream's
    rate, so it is sampled like the same frames in an MP4, not refused as frameless."""
    frames = gradient_video(12, 64, 48, 3).frames
    raw = encode_video(frames, 4, "libx264", "h264")
    video = load_video_bytes(raw, VideoLimits(fps=2.0))
    assert 2 <= video.num_frames <= 12 and video.num_frames % 2 == 0 and video.size == (48, 64)
