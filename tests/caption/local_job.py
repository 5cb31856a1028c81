"""Run a caption job on an already started backend, as the CLI would (resume included)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mm_serve.caption.backends import CaptionBackend
from mm_serve.caption.inputs import read_inputs
from mm_serve.caption.output import OutputFile
from mm_serve.caption.runner import CaptionJob
from mm_serve.caption.summary import JobStats


def run_job(backend: CaptionBackend, source: Path, out: Path, *, retry_errors: bool = False,
            concurrency: int = 16, in_order: bool = False) -> JobStats:
    """Resume ``out`` and run the job as the CLI does, without starting a new backend."""
    inputs = read_inputs(source, "Describe the image.")
    writer, resume = OutputFile.open(out, inputs.format, retry_errors=retry_errors)
    try:
        todo = [item for item in inputs.items if item.id not in resume.done]
        job = CaptionJob(todo, inputs.format, backend, writer, concurrency=concurrency, in_order=in_order,
                         skipped=len(inputs.items) - len(todo))
        return asyncio.run(job.run())
    finally:
        writer.close()
