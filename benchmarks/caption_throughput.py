"""Caption throughput: the ``mm-serve caption`` job vs the same images sent one at a time.

Both runs use the same in-process disaggregated engine (started once, warmed up)
and the same job code; only the in-flight window differs:

* job: ``--concurrency`` inputs in flight (default: the engine's default, 2 x
  ``scheduler.decode_max_concurrent``), so the decode batch stays full;
* one at a time: a window of 1, i.e. sequential requests: load, submit, wait, next.

images/s = images / wall time of the run (engine start-up excluded, image loading
included). The images are drawn scenes (held-out stream, seed 1), saved as PNG.
The two runs alternate ``--rounds`` times (default 3) on the same engine; the
figures reported are medians (the one-at-a-time rate moves by ~±5 % between runs).

Usage::

    python benchmarks/caption_throughput.py [--model embedded|tiny|DIR] [--images 256] [--max-tokens 32]
                                            [--concurrency N] [--rounds 3] [--config YAML] [--set KEY=VALUE ...]
                                            [--server URL]

``--server URL`` measures an OpenAI-compatible server instead (ours or another);
there the one-at-a-time run is also a window of 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mm_serve.caption.backends import CaptionBackend  # noqa: E402
from mm_serve.caption.inputs import read_inputs  # noqa: E402
from mm_serve.caption.output import OutputFile  # noqa: E402
from mm_serve.caption.runner import CaptionJob  # noqa: E402
from mm_serve.caption.summary import JobStats  # noqa: E402
from mm_serve.models.named_models import EMBEDDED_MODEL_DIR  # noqa: E402


def _model_dir(name: str) -> Path:
    """``embedded`` (falls back to ``tiny`` until it exists), ``tiny`` (built once into /tmp) or a directory."""
    if name == "embedded" and (EMBEDDED_MODEL_DIR / "model.safetensors").is_file():
        return EMBEDDED_MODEL_DIR
    if name not in ("embedded", "tiny"):
        return Path(name)
    from mm_serve.models.builder import TinyModelSpec, build_llava

    out = Path(tempfile.gettempdir()) / "mm_serve_bench_tiny_llava"
    if not (out / "model.safetensors").is_file():
        build_llava(out, seed=0, spec=TinyModelSpec())
    print(f"note: using the random tiny llava checkpoint {out}" + (" (embedded not trained yet)" if name == "embedded" else ""))
    return out


def _draw_images(folder: Path, n: int) -> None:
    from mm_serve.shapes.scenes import draw_scene, scene_rng

    for index in range(n):
        image, _ = draw_scene(scene_rng("heldout", 1, index))
        image.save(folder / f"scene{index:04d}.png")


async def _timed(backend: CaptionBackend, folder: Path, out: Path, concurrency: int) -> JobStats:
    inputs = read_inputs(folder, "Describe the image.")
    writer, _ = OutputFile.open(out, inputs.format)
    try:
        return await CaptionJob(inputs.items, inputs.format, backend, writer, concurrency=concurrency).run()
    finally:
        writer.close()


async def _measure(backend: CaptionBackend, folder: Path, work: Path, concurrency: int | None,
                   warmup: Path, rounds: int) -> list[tuple[JobStats, JobStats]]:
    """``rounds`` x (job, then one at a time), alternating, so slow drifts hit both alike."""
    await _timed(backend, warmup, work / "warmup.jsonl", 4)
    out = []
    for r in range(rounds):
        job = await _timed(backend, folder, work / f"job{r}.jsonl", concurrency or backend.default_concurrency)
        single = await _timed(backend, folder, work / f"single{r}.jsonl", 1)
        out.append((job, single))
    return out


def _start_backend(args: argparse.Namespace) -> CaptionBackend:
    if args.server:
        from mm_serve.caption.server_backend import ServerBackend

        return ServerBackend(args.server, model=args.served_model, max_tokens=args.max_tokens)
    from mm_serve.caption.engine_backend import EngineBackend
    from mm_serve.config import ConfigError, load_config

    model_dir = _model_dir(args.model)
    overrides: dict[str, object] = {"model": str(model_dir)}
    for pair in args.set:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"caption_throughput.py: error: --set {pair!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        raise SystemExit(f"caption_throughput.py: error: {exc}") from None
    print(f"starting the {config.mode} engine for {model_dir} ...", flush=True)
    return EngineBackend.start(model_dir, config, max_tokens=args.max_tokens)


async def _run(args: argparse.Namespace, backend: CaptionBackend, folder: Path, work: Path,
               warmup: Path) -> list[tuple[JobStats, JobStats]]:
    start = getattr(backend, "start", None)
    if args.server and start is not None:
        await start()
    try:
        return await _measure(backend, folder, work, args.concurrency, warmup, args.rounds)
    finally:
        if args.server:
            await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="embedded (default), tiny, or a checkpoint directory")
    parser.add_argument("--config", default=None, help="YAML service config of the in-process engine")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. compute.prefill_workers=2 (repeatable; VALUE is YAML)")
    parser.add_argument("--server", default=None, help="measure this OpenAI-compatible server instead")
    parser.add_argument("--served-model", default=None, help="--server: model name (default: first listed)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=None, help="job window (default: the backend's)")
    parser.add_argument("--rounds", type=int, default=3, help="job / one-at-a-time pairs; medians are reported")
    args = parser.parse_args()
    if args.images < 1 or args.rounds < 1:
        parser.error("--images and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="caption-bench-") as tmp:
        work = Path(tmp)
        folder, warmup = work / "images", work / "warmup"
        folder.mkdir()
        warmup.mkdir()
        _draw_images(folder, args.images)
        _draw_images(warmup, 4)
        backend = _start_backend(args)
        try:
            rounds = asyncio.run(_run(args, backend, folder, work, warmup))
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()
    window = args.concurrency or backend.default_concurrency
    failed = sum(job.failed + single.failed for job, single in rounds)
    print(f"images: {args.images}, max_tokens: {args.max_tokens}, rounds: {args.rounds}, failed: {failed}")
    for r, (job, single) in enumerate(rounds):
        print(f"round {r + 1}: job (window {window}) {job.images_per_s:7.2f} images/s "
              f"(latency p50 {job.to_dict()['latency_p50_s']} s) | one at a time {single.images_per_s:7.2f} "
              f"images/s (latency p50 {single.to_dict()['latency_p50_s']} s) | "
              f"{job.images_per_s / max(single.images_per_s, 1e-9):.2f}x")
    job_rate = statistics.median(job.images_per_s for job, _ in rounds)
    single_rate = statistics.median(single.images_per_s for _, single in rounds)
    ratio = statistics.median(job.images_per_s / max(single.images_per_s, 1e-9) for job, single in rounds)
    print(f"median: job {job_rate:.2f} images/s, one at a time {single_rate:.2f} images/s, "
          f"speed-up {ratio:.2f}x (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
