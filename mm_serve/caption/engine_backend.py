"""The in-process backend: a disaggregated engine (prefill and decode workers) in this job.

Per input: load and decode the image and run the input processor (chat template,
tokenize, normalise pixels) in a thread pool, so the event loop keeps submitting
while images load; then submit to the engine and await the result. OpenAI batch
rows go through :class:`~mm_serve.caption.engine_batch.EngineBatchRequests`,
which applies the API server's own request rules.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mm_serve.caption.backends import CaptionBackend, load_item_image, read_error_message
from mm_serve.caption.engine_batch import EngineBatchRequests
from mm_serve.caption.engine_requests import raise_if_engine_down, submit_all, wait_finished
from mm_serve.caption.inputs import CaptionInput
from mm_serve.caption.records import Outcome, failure
from mm_serve.config import ServiceConfig
from mm_serve.engine.engine_client import EngineClient
from mm_serve.inputs.input_processor import InvalidRequestError, ProcessedInputs
from mm_serve.media.errors import ImageError
from mm_serve.media.video_loading import decode_video_data_uri, load_video_file
from mm_serve.pipeline.media import video_limits
from mm_serve.runtime.sampling_params import SamplingParams


class EngineBackend(CaptionBackend):
    """Captions with an :class:`EngineClient` that this backend owns (and shuts down).

    Args:
        client: a started engine client.
        max_tokens: new tokens at most per caption.
        temperature: sampling temperature for captions (0 = greedy).
        model_name: the model name written into OpenAI batch response bodies.
        load_threads: threads that load and preprocess images.
    """

    name = "in-process engine"

    def __init__(self, client: EngineClient, *, max_tokens: int, temperature: float = 0.0,
                 model_name: str = "embedded", load_threads: int = 4) -> None:
        self.client = client
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        self.max_pixels = client.config.api.max_image_pixels
        self._pool = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="caption-load")
        self._batch = EngineBatchRequests(client, model_name)

    @classmethod
    def start(cls, model_dir: str | Path, config: ServiceConfig, **kwargs: Any) -> EngineBackend:
        """Start the workers of ``config`` for ``model_dir`` (blocks until they are ready).

        Raises:
            CheckpointError: the checkpoint cannot be loaded.
            WorkerStartError: a worker failed to start (everything is cleaned up).
        """
        client = EngineClient(model_dir, config)
        client.start()
        try:
            return cls(client, **kwargs)
        except BaseException:
            client.shutdown()
            raise

    @property
    def default_concurrency(self) -> int:
        """Twice the decode batch of every decode worker: the prefill queue never runs dry."""
        cfg = self.client.config
        workers = 1 if cfg.mode == "colocated" else cfg.compute.decode_workers
        return 2 * cfg.scheduler.decode_max_concurrent * workers

    async def run(self, item: CaptionInput) -> Outcome:
        """Caption one input (see :class:`CaptionBackend` for the contract)."""
        start = time.perf_counter()
        if item.body is not None:
            return await self._batch.run(item, start)
        loop = asyncio.get_running_loop()
        try:
            inputs = await loop.run_in_executor(self._pool, self._prepare, item)
            states = submit_all(self.client, inputs, [self.params])
        except OSError as exc:
            return failure(time.perf_counter() - start, read_error_message(item, exc), "image_unreadable")
        except ImageError as exc:
            return failure(time.perf_counter() - start, str(exc), "invalid_image")
        except InvalidRequestError as exc:
            return failure(time.perf_counter() - start, str(exc), "invalid_request")
        await wait_finished(self.client, states)
        raise_if_engine_down(self.client, states)
        state = states[0]
        latency = time.perf_counter() - start
        if state.error:
            return failure(latency, f"the request failed: {state.error}", "request_failed", 503)
        return Outcome(
            latency_s=latency, caption=state.text.strip(), prompt_tokens=state.num_prompt_tokens,
            completion_tokens=len(state.token_ids), status_code=200, request_id=state.request_id,
        )

    def _prepare(self, item: CaptionInput) -> ProcessedInputs:
        """Image (or video, sampled as the server samples one: ``api.video_fps``, ``api.max_video_frames``) →
        model inputs, in a pool thread (decoding and preprocessing release the GIL)."""
        if item.is_video:
            assert item.image is not None
            limits = video_limits(self.client.config.api)
            data_uri = item.image[:5].lower() == "data:"
            video = decode_video_data_uri(item.image, limits) if data_uri else load_video_file(item.image, limits)
            part: dict[str, Any] = {"type": "video", "video": video}
        else:
            part = {"type": "image", "image": load_item_image(item, self.max_pixels)}
        content = [part, {"type": "text", "text": item.prompt}]
        return self.client.inputs.process({"messages": [{"role": "user", "content": content}]})

    async def aclose(self) -> None:
        """Stop the loader threads and the engine's workers (unlinks shared memory)."""
        self.close()

    def close(self) -> None:
        """Synchronous :meth:`aclose`, for callers outside an event loop. Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()
