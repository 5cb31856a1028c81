"""Decode user-supplied videos (raw bytes, ``data:video/...`` URIs, files) into sampled RGB frames.

Untrusted bytes go through :func:`load_video_bytes` with PyAV (FFmpeg's demuxers and decoders), in
two passes under :class:`VideoLimits`:

1. **demux only**: the first video stream's packets are counted and their timestamps read, without
   decoding a pixel; the frame size its codec declares, the duration and the frame count are checked
   here, so an over-long video or a frame bomb costs a header and packet walk, not a decode;
2. **decode**: frames are decoded in order and only the sampled ones kept (as ``uint8`` RGB), so
   memory holds ``frames kept x height x width x 3`` bytes, never the whole video.

Sampling follows transformers' ``Qwen2VLVideoProcessor.sample_frames`` over the metadata its PyAV reader
makes: the video holds ``total`` frames at ``rate`` frames a second (the stream's average rate);
``n = total / rate * fps`` frames, at least ``min_frames`` (4), at most ``max_frames`` and the video's own,
rounded down to whole temporal patches (2 frames), are taken at the indices ``floor(i * total / n)``; their
rate ``n / total * rate`` (``VideoMetadata.sampled_fps``) is what :attr:`Video.fps` reports (Qwen2.5-VL's
M-RoPE spaces temporal positions by it). A video of one frame keeps it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mm_serve.media.errors import ImageError
from mm_serve.media.local_file import read_media_file


class VideoError(ImageError):
    """The client sent a video that cannot be used (HTTP 400): not a video, corrupt, too long, too many
    frames, frames too large."""


@dataclass(frozen=True)
class VideoLimits:
    """Limits for decoding one video and how its frames are sampled; never mutated."""

    fps: float = 2.0
    """Frames sampled per second of video (fewer when ``max_frames`` binds)."""
    max_frames: int = 32
    """Most frames sampled from one video."""
    max_seconds: float = 600.0
    """Longest accepted video, in seconds."""
    max_frame_pixels: int = 1920 * 1080
    """Largest accepted ``width * height`` of a frame, in pixels (checked before any frame is decoded)."""
    max_stream_frames: int = 36_000
    """Most frames the stream may hold (a 10-minute video at 60 fps), checked before decoding."""

    def __post_init__(self) -> None:
        if not self.fps > 0 or not self.max_seconds > 0:
            raise ValueError(f"fps and max_seconds must be > 0, got {self.fps} and {self.max_seconds}")
        for name in ("max_frames", "max_frame_pixels", "max_stream_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Video:
    """Sampled frames of one video: ``frames`` ``[T, H, W, 3]`` uint8 RGB, sampled at ``fps`` frames per
    second of the original (``T / duration``)."""

    frames: np.ndarray
    fps: float

    def __post_init__(self) -> None:
        shape = self.frames.shape
        if self.frames.dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3 or not shape[0]:
            raise VideoError(f"a video's frames must be uint8 [frames, height, width, 3] RGB, got {self.frames.dtype} "
                             f"{list(shape)}")
        if not self.fps > 0:
            raise VideoError(f"a video's frame rate must be > 0, got {self.fps}")

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of its frames, in pixels."""
        return int(self.frames.shape[1]), int(self.frames.shape[2])


Reserve = Callable[[int], None]
"""Called with the bytes a video's decoding will hold, once its packets are surveyed and before any frame is
decoded; raises to refuse (the API's image budget, :class:`~mm_serve.admission.byte_budget.Hold`)."""

MIN_FRAMES = 4  # transformers' Qwen2VLVideoProcessor.min_frames
TEMPORAL_PATCH = 2  # frames per temporal patch: the sampled count is a multiple of it


def sample_indices(total: int, rate: float, fps: float, max_frames: int) -> list[int]:
    """Indices of the frames to keep among ``total`` frames at ``rate`` frames a second: ``n`` frames (module
    docstring) at ``floor(i * total / n)``, as ``Qwen2VLVideoProcessor.sample_frames`` with ``fps`` (in float32,
    as its ``torch.arange``)."""
    import torch

    cap = min(max_frames, total) // TEMPORAL_PATCH * TEMPORAL_PATCH
    if cap < TEMPORAL_PATCH:  # one frame (or a cap of one): keep the first
        return [0]
    n = min(max(total / rate * fps, MIN_FRAMES), cap, total)
    n = max(TEMPORAL_PATCH, int(n // TEMPORAL_PATCH * TEMPORAL_PATCH))
    return sorted(set(torch.arange(0, total, total / n).int().tolist()))


def decoded_bytes(frames: int, width: int, height: int) -> int:
    """Bytes ``frames`` sampled frames of ``width x height`` hold while they become model inputs: the RGB
    frames, the video processor's copy of them and its float32 normalised frames (resized, but never
    assumed smaller than they were): 6 x 3 bytes a pixel."""
    return frames * width * height * 3 * 6


def load_video_bytes(data: bytes, limits: VideoLimits, reserve: Reserve | None = None) -> Video:
    """Demux, check, decode and sample an encoded video (any container and codec this FFmpeg build reads);
    ``reserve`` is given :func:`decoded_bytes` of the frames to keep before any is decoded.

    Raises:
        VideoError: empty or not a video, no video stream, corrupt, a frame over ``limits.max_frame_pixels``,
            longer than ``limits.max_seconds``, more than ``limits.max_stream_frames`` frames, or frames
            that change size.
    """
    import av

    if not data:
        raise VideoError("video data is empty")
    try:
        total, rate, (width, height) = _survey(av, data, limits)
    except VideoError:
        raise
    except Exception as exc:  # FFmpeg errors (av.FFmpegError) and anything a bad stream trips
        raise VideoError(f"video data is not a readable video ({type(exc).__name__})") from None
    keep = set(sample_indices(total, rate, limits.fps, limits.max_frames))
    if reserve is not None:  # may refuse: raised as it is
        reserve(decoded_bytes(len(keep), width, height))
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index > max(keep):
                    break
                if index not in keep:
                    continue
                if (frame.width, frame.height) != (width, height):
                    raise VideoError(f"video frames change size ({width}x{height}, then {frame.width}x{frame.height})")
                frames.append(frame.to_ndarray(format="rgb24"))
    except VideoError:
        raise
    except Exception as exc:  # FFmpeg errors (av.FFmpegError) and anything a bad stream trips
        raise VideoError(f"video data is not a readable video ({type(exc).__name__})") from None
    if not frames:
        raise VideoError("the video has no decodable frame")
    return Video(np.stack(frames), len(frames) / total * rate)


def _survey(av: object, data: bytes, limits: VideoLimits) -> tuple[int, float, tuple[int, int]]:
    """(frames, frames a second, (width, height)) of the first video stream, from its packets alone.

    A packet's time is its presentation time, else its decode time; a raw stream without either counts
    its packets at the stream's rate. The rate is the stream's average (what transformers' PyAV reader
    reads), else the packets' mean over their span; the length checked is that span.

    Raises:
        VideoError: no video stream, a still image, no frame, or a limit of ``limits`` passed.
    """
    with av.open(io.BytesIO(data), mode="r") as container:  # type: ignore[attr-defined]
        if not container.streams.video:
            raise VideoError("the data holds no video stream")
        name = container.format.name
        if name.endswith("_pipe") or name.startswith("image2"):
            raise VideoError(f"the data is a still image ({name.removesuffix('_pipe')}), not a video; send it as "
                             "an image_url part")
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width < 1 or height < 1:
            raise VideoError(f"video has an empty frame size {width}x{height}")
        if width * height > limits.max_frame_pixels:
            raise VideoError(f"video frames are too large: {width}x{height} = {width * height} pixels exceeds the limit "
                             f"of {limits.max_frame_pixels}")
        base = float(stream.time_base or 0)
        average = float(stream.average_rate or 0)
        times: list[float] = []
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            stamp = packet.pts if packet.pts is not None else packet.dts
            times.append(stamp * base if stamp is not None and base else len(times) / (average or 25.0))
            if len(times) > limits.max_stream_frames:
                raise VideoError(f"video has more than {limits.max_stream_frames} frames; refused")
            if times[-1] - times[0] > limits.max_seconds:
                raise VideoError(f"video is longer than the limit of {limits.max_seconds:g} s")
    if not times:
        raise VideoError("the video has no frame")
    if len(times) == 1 and name == "gif":
        raise VideoError("the data is a still image (a GIF of one frame), not a video; send it as an image_url part")
    span = max(times) - min(times)
    rate = average if average > 0 else ((len(times) - 1) / span if span > 0 else 1.0)
    return len(times), rate, (width, height)


def decode_video_data_uri(uri: str, limits: VideoLimits, reserve: Reserve | None = None) -> Video:
    """Decode a ``data:video/<format>;base64,<payload>`` URI (whitespace in the payload ignored), as
    :func:`load_video_bytes`.

    Raises:
        VideoError: not a ``data:video/`` base64 URI, bad base64, or as :func:`load_video_bytes`.
    """
    text = uri.strip()
    header, separator, payload = text[5:].partition(",")
    params = [part.strip().lower() for part in header.split(";")]
    if text[:5].lower() != "data:" or not separator or not params[0].startswith("video/") or params[-1] != "base64":
        raise VideoError("a video data URI must be of the form data:video/<format>;base64,<data>")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise VideoError("video data URI payload is not valid base64") from None
    return load_video_bytes(data, limits, reserve)


def load_video_file(path: str | os.PathLike[str], limits: VideoLimits) -> Video:
    """Read a regular file of at most :data:`~mm_serve.media.local_file.MAX_MEDIA_FILE_BYTES` and decode it with
    :func:`load_video_bytes`.

    Raises:
        OSError: the file cannot be read, is not a regular file or is larger than that
            (:func:`~mm_serve.media.local_file.read_media_file`).
        VideoError: as :func:`load_video_bytes`.
    """
    return load_video_bytes(read_media_file(path), limits)


def encode_video(frames: np.ndarray, fps: float, codec: str = "mpeg4", container_format: str = "mp4") -> bytes:
    """``frames`` ``[T, H, W, 3]`` uint8 RGB encoded with ``codec`` in a ``container_format`` file at ``fps``
    (test and benchmark clips; even ``H`` and ``W``, as yuv420p needs; ``fps`` rounded to whole frames per
    second; ``libvpx`` in ``webm``)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        stream: Any = container.add_stream(codec, rate=max(1, round(fps)))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()
