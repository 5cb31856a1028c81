"""Interactive SLO attainment with and without a Batch API batch running, on one server, in one run.

Starts ``mm-serve serve`` (``--config``, ``--model``; the Batch API on a temporary
data directory), then:

1. a warm-up, then interactive llava requests (``mm-serve bench``'s llava workload:
   one image, a short question, ~48-token answers, streamed) at ``--fraction`` of
   ``--goodput`` requests/s, alone;
2. a batch of ``--batch-images`` caption rows (one noise image each, 20-40 output
   tokens, as the caption workload) is created, and once it is in progress the same
   interactive run (same shapes and times, other images and text: nothing served from
   the caches of the first) is sent again (batch rows run in the ``batch`` SLO tier);
3. the batch then runs alone for ``--alone-s`` seconds (its images/s alone) and is
   cancelled, and an interactive run (other content again) is sent once more alone (so a drift of the
   machine between runs shows).

It prints both attainments (TTFT and TPOT SLOs, over all planned requests), their
difference in points, the TTFT/TPOT percentiles, and the batch's images/s during the
interactive run and over its whole life. The batch runs at most
``batch.max_in_flight_rows`` rows at once (``--max-in-flight`` overrides it), each in
the ``batch`` SLO tier: prefilled after interactive work, preempted first.

Usage::

    make bench-models
    python benchmarks/batch_interference.py --config configs/image_chat.yaml --model out/bench-llava \\
        --goodput 6.43 --fraction 0.7 --requests 120 --batch-images 1000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import yaml  # noqa: E402

from mm_serve.bench.client import Endpoint  # noqa: E402
from mm_serve.bench.launch import LocalServer  # noqa: E402
from mm_serve.bench.metrics import RunSummary  # noqa: E402
from mm_serve.bench.requests import RequestFactory, noise_image_uri  # noqa: E402
from mm_serve.bench.runner import LoadRunner, LoadSpec  # noqa: E402
from mm_serve.bench.sweep import find_goodput  # noqa: E402
from mm_serve.ground.slo import SLO  # noqa: E402
from mm_serve.models.registry import load_model_config  # noqa: E402
from mm_serve.workloads import make_workload  # noqa: E402


def _batch_file(images: int, image_size: int, seed: int) -> bytes:
    """``images`` caption rows, each a distinct noise image and 20-40 output tokens."""
    rng = random.Random(f"batch:{seed}")
    lines = []
    for i in range(images):
        body = {"model": "bench", "max_tokens": rng.randint(20, 40), "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": noise_image_uri(image_size, 10_000 + i)}},
                    {"type": "text", "text": "Describe the image."}]}]}
        lines.append(json.dumps({"custom_id": f"img-{i:05d}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _counts(http: httpx.Client, batch_id: str) -> dict[str, Any]:
    return http.get(f"/v1/batches/{batch_id}").json()


def _line(name: str, run: RunSummary) -> str:
    return (f"{name:<22} attainment {run.attainment * 100:5.1f} %   TTFT p50/p90/p99 {run.ttft.p50 * 1e3:6.0f} / "
            f"{run.ttft.p90 * 1e3:6.0f} / {run.ttft.p99 * 1e3:6.0f} ms   TPOT p50/p90/p99 {run.tpot.p50 * 1e3:5.1f} / "
            f"{run.tpot.p90 * 1e3:5.1f} / {run.tpot.p99 * 1e3:5.1f} ms   ({run.num_ok}/{run.num_requests} ok)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/image_chat.yaml")
    p.add_argument("--model", default="out/bench-llava")
    p.add_argument("--goodput", default="6.43",
                   help="the config's llava goodput, requests/s (6.43 on the 2-core dev machine), or 'auto': "
                        "search it first on this server (mm-serve bench's search: doubling or halving from 6.43, then "
                        "bisecting to within 15 %%, --search-requests each)")
    p.add_argument("--search-requests", type=int, default=120,
                   help="requests per goodput-search probe (short probes overstate the goodput: 40-request "
                        "probes found 15.3 req/s, at which 120-request runs at 70 %% met 72-76 %%)")
    p.add_argument("--fraction", type=float, default=0.7, help="interactive rate as a fraction of --goodput")
    p.add_argument("--requests", type=int, default=120, help="interactive requests per run")
    p.add_argument("--batch-images", type=int, default=1000)
    p.add_argument("--max-in-flight", type=int, default=None, help="batch.max_in_flight_rows (default: the config's)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--alone-s", type=float, default=60.0, help="seconds the batch runs alone before it is cancelled")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model_dir = Path(args.model)
    shape = load_model_config(model_dir)
    assert shape.vision is not None, "the llava workload needs a vision checkpoint"
    work = Path(tempfile.mkdtemp(prefix="mm-serve-batch-bench-"))
    cfg = yaml.safe_load(Path(args.config).read_text()) or {}
    cfg.setdefault("batch", {})["data_dir"] = str(work / "data")
    if args.max_in_flight:
        cfg["batch"]["max_in_flight_rows"] = args.max_in_flight
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    slo = SLO(args.slo_ttft, args.slo_tpot)
    data = _batch_file(args.batch_images, shape.vision.image_size, args.seed)

    server = LocalServer(work / "server.log", str(config), str(model_dir))
    url = server.start()
    try:
        workload = make_workload("llava", shape.vision.num_image_tokens, shape.text.max_position_embeddings)
        factory = RequestFactory("bench", "chat", model_dir, shape.vision.image_size)

        def runner_for(run: int) -> LoadRunner:  # each run its own content: no prefix or encoder cache hits
            spec = LoadSpec(workload, args.seed, num_requests=args.requests, content_salt=run)
            return LoadRunner(Endpoint(url), factory, spec, slo, 0.9, early_stop=False)

        runner = runner_for(0)
        runner.unloaded(4)
        if args.goodput == "auto":
            search = LoadRunner(Endpoint(url), factory, LoadSpec(workload, args.seed + 1, num_requests=args.search_requests), slo, 0.9,
                                on_run=lambda r: print(f"  goodput search: {r.rate:.2f} req/s -> "
                                                       f"{r.attainment * 100:.1f} %", flush=True))
            goodput = find_goodput(search.run_at, 0.9, 6.43, rel_tol=0.15).goodput
            if goodput <= 0:
                raise SystemExit("no rate meets the SLO on this machine now")
        else:
            goodput = float(args.goodput)
        rate = args.fraction * goodput
        print(f"interactive llava at {rate:.2f} requests/s ({args.fraction:.0%} of {goodput:.2f} req/s), "
              f"{args.requests} requests per run; batch of {args.batch_images} images; SLO TTFT {slo.ttft_s:g} s, "
              f"TPOT {slo.tpot_s * 1e3:g} ms; work dir {work}", flush=True)
        alone = runner_for(1).run_at(rate)
        print(_line("interactive alone", alone), flush=True)

        with httpx.Client(base_url=url, timeout=300) as http:
            file_id = http.post("/v1/files", files={"file": ("batch.jsonl", io.BytesIO(data))},
                                data={"purpose": "batch"}).json()["id"]
            batch = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}).json()
            while _counts(http, batch["id"])["request_counts"]["completed"] < 1:
                time.sleep(0.05)
            t0, c0 = time.monotonic(), _counts(http, batch["id"])["request_counts"]["completed"]
            together = runner_for(2).run_at(rate)
            t1, state = time.monotonic(), _counts(http, batch["id"])
            c1 = state["request_counts"]["completed"]
            print(_line("with the batch running", together), flush=True)
            if c1 >= args.batch_images:
                print("note: the batch finished during the interactive run (use more --batch-images)")
            time.sleep(args.alone_s)  # the batch alone
            t2, c2 = time.monotonic(), _counts(http, batch["id"])["request_counts"]["completed"]
            http.post(f"/v1/batches/{batch['id']}/cancel")
            while state["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.2)
                state = _counts(http, batch["id"])
        after = runner_for(3).run_at(rate)
        print(_line("alone again, after", after), flush=True)
        base = (alone.attainment + after.attainment) / 2
        print(f"attainment difference: {(base - together.attainment) * 100:+.1f} points against the mean of the "
              f"two runs alone (goal: within 5)")
        print(f"batch: {(c1 - c0) / (t1 - t0):.1f} images/s during the interactive run, "
              f"{(c2 - c1) / (t2 - t1):.1f} images/s alone ({args.alone_s:g} s; then cancelled: "
              f"{state['request_counts']['completed']} of {args.batch_images} done, "
              f"{state['request_counts']['failed']} failed)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
