"""The contract every caption backend meets, and the image loading they share.

Two backends implement :class:`CaptionBackend`:

* :class:`~mm_serve.caption.engine_backend.EngineBackend`: an in-process
  disaggregated engine (:class:`~mm_serve.engine.engine_client.EngineClient`);
* :class:`~mm_serve.caption.server_backend.ServerBackend`: any OpenAI-compatible
  HTTP server (ours or another), images sent as data URIs.

Images of folder and JSONL inputs are loaded here with the server's own loader
(:mod:`mm_serve.media.image_loading`), before anything is sent, so a broken image
gives the same error message whichever backend runs the job.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from mm_serve.caption.inputs import CaptionInput, printable_name
from mm_serve.caption.records import Outcome
from mm_serve.config import APIConfig

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_MAX_IMAGE_PIXELS: int = APIConfig.model_fields["max_image_pixels"].default
"""The image-size limit (width x height, px) with no config: ``api.max_image_pixels``'s default."""


class FatalBackendError(RuntimeError):
    """The service cannot take requests any more (a worker died, the server is unreachable).

    The job stops; inputs not finished are not written, so a re-run does them.
    """


class CaptionBackend(abc.ABC):
    """Runs one input to an :class:`Outcome`.

    Contract:

    * :meth:`run` is called on the job's event loop, up to ``concurrency`` calls at a
      time; it must never block the loop (image decoding and preprocessing run in
      threads).
    * A problem of the input itself (unreadable or broken image, an invalid request,
      a request the service answered with an error) is returned as a failure
      :class:`Outcome`, never raised.
    * :class:`FatalBackendError` is raised when the service itself is gone; the
      runner then stops the job.
    * When the awaiting task is cancelled (Ctrl-C), the request is aborted in the
      service and ``CancelledError`` propagates.
    """

    name: str = "backend"

    @property
    @abc.abstractmethod
    def default_concurrency(self) -> int:
        """Requests in flight that keep the service's decode batch full."""

    @abc.abstractmethod
    async def run(self, item: CaptionInput) -> Outcome:
        """Caption ``item`` (or answer its OpenAI batch body); see the class contract."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections, threads and worker processes. Idempotent."""


def load_item_image(item: CaptionInput, max_pixels: int) -> Image.Image:
    """Load and fully decode the image of a folder or JSONL input (call it in a thread).

    Args:
        item: an input with ``image`` set (a file path or a ``data:`` URI).
        max_pixels: the largest accepted ``width * height``, in pixels.

    Returns:
        An upright RGB image.

    Raises:
        OSError: the file cannot be read (the message names it).
        mm_serve.media.errors.ImageError: not an image, corrupt or truncated, too large,
            or a malformed data URI.
    """
    from mm_serve.media.image_loading import decode_data_uri, load_image_file

    if item.image is None:
        raise ValueError(f"input {item.id!r} has no image (an OpenAI batch row?)")
    if item.image[:5].lower() == "data:":
        return decode_data_uri(item.image, max_pixels=max_pixels)
    return load_image_file(item.image, max_pixels=max_pixels)


def read_error_message(item: CaptionInput, exc: OSError) -> str:
    """The error text for an image (or video) file that cannot be read."""
    reason = exc.strerror or str(exc)
    return f"cannot read {'video' if item.is_video else 'image'} file {printable_name(str(item.image))}: {reason}"
