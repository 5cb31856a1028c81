"""The placement ``mm-serve serve`` runs when the config pins none: the planner's choice for this machine.

A DistServe-style system chooses its placement from the hardware and the SLOs (Zhong et al.,
OSDI 2024, §4). With ``placement.auto`` (the default) and none of :data:`PLACEMENT_KEYS` given
(in the config file or as flags) and no GPU ids, ``mm-serve serve``:

1. takes a profile of the served checkpoint on this machine (:func:`cached_profile`): read from
   the profile cache, else measured once (one torch thread per pass, as each pinned worker runs,
   then the same sizes on 2, 4, ... threads up to the usable cores, as a worker given that many
   cores runs: :func:`parallel_degrees`; tens of seconds on a few cores, more with each degree)
   and written there, under a key of the checkpoint's ``config.json``, the dtype, the CPU model,
   the usable cores, the torch version and the sizes measured;
2. runs the planner's search (:func:`mm_serve.planner.search.plan`) on it with one device per
   usable core, the workload ``placement.workload`` and the SLO of the default tier
   (:func:`choose_placement`);
3. where the config sets neither the decode pacing nor ``compute.prefill_worker_nice``, also
   simulates a prefill worker on every core with the decode worker sharing the last one, that
   core split by niceness and decode pacing (:mod:`mm_serve.planner.shared_core`);
4. runs the candidate predicting the most goodput, the simpler on a tie: colocated on every core
   (one instance of TP = the cores, or the largest degree the heads allow), the disaggregated unit
   (N prefill and M decode workers, each pinned to its planned cores), or the shared core with its
   pacing and niceness (:func:`apply_placement`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import glob
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mm_serve.cluster.launcher import available_cpus
from mm_serve.config import ServiceConfig, config_from_dict
from mm_serve.ground.slo import SLO
from mm_serve.models.model_config import CheckpointError
from mm_serve.planner.candidates import tp_degrees
from mm_serve.planner.errors import PlannerError, ProfileError
from mm_serve.planner.evaluator import GoodputEvaluator
from mm_serve.planner.fit import get_hardware
from mm_serve.planner.latency_model import ParallelConfig
from mm_serve.planner.model_shape import load_model_shape
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.profile_file import parse_profile
from mm_serve.planner.search import PlanResult, plan
from mm_serve.planner.shared_core import PACINGS, SHARED_NICE_STEP, SharedCorePlacement, cfs_share
from mm_serve.runtime.core_load import CoreLoad
from mm_serve.workloads import make_workload

PLACEMENT_KEYS = ("mode", "compute.prefill_workers", "compute.decode_workers", "compute.prefill_cpus",
                  "compute.decode_cpus", "compute.prefill_gpus", "compute.decode_gpus")
BUSY_SHARE_LIMIT = 0.2  # a profile measured while others kept more of its cores busy is not reused
UNDER_LOAD_KEY = "measured_under_load"  # in a profile file: that share (the next start measures again)
PLANS_KEPT = 16  # saved plans kept beside a profile (one per SLO, workload, checkpoint and planner source seen)
PROFILE_SIZES = {"prefill_tokens": (32, 256, 1024), "decode_batches": (1, 8, 32), "decode_contexts": (128, 512)}


@dataclass(frozen=True)
class PlacementChoice:
    """What the planner chose for this machine and why.

    ``predicted``: each candidate's predicted goodput on the whole machine, requests/s (the one
    colocated instance on every core, the disaggregated unit under its ``NpMd`` name).
    """

    mode: str  # "colocated" or "disaggregated"
    prefill_workers: int
    decode_workers: int
    prefill_cpus: list[int]
    decode_cpus: list[int]
    predicted: dict[str, float]
    workload: str
    slo: SLO
    cores: int
    profile: str  # the profile file the planner fitted
    profile_measured: bool  # measured at this start (False: read from the cache)
    seconds: float  # the planner's search time
    candidates: dict[str, str] = field(default_factory=dict)  # candidate name -> its cores, in words
    shared_core: SharedCorePlacement | None = None  # the decode worker shares the last prefill core
    prefill_worker_nice: int | None = None  # that core's prefill worker's niceness (shared_core only)
    profile_under_load: float | None = None  # the busy share of its cores while it was measured, if over the limit
    plan_reused: bool = False  # read from the plan saved beside the profile by an earlier start (no search)

    @property
    def keys(self) -> dict[str, Any]:
        """The placement keys it sets (:func:`apply_placement`'s arguments); a shared core adds
        the decode pacing and the niceness of the prefill worker beside the decode worker."""
        keys: dict[str, Any] = {"mode": self.mode, "prefill_workers": self.prefill_workers,
                                "decode_workers": self.decode_workers, "prefill_cpus": self.prefill_cpus,
                                "decode_cpus": self.decode_cpus}
        if self.shared_core is not None:
            keys.update(decode_step_pacing=self.shared_core.pacing, prefill_worker_nice=self.prefill_worker_nice)
        return keys

    @property
    def name(self) -> str:
        if self.shared_core is not None:
            return self.shared_core.name
        return "colocated" if self.mode == "colocated" else f"{self.prefill_workers}P+{self.decode_workers}D"

    def describe(self) -> str:
        """The log line: the choice, each candidate's predicted goodput, the inputs."""
        figures = ", ".join(f"{name} {rate:.2f} req/s" for name, rate in self.predicted.items())
        saved = ", the plan saved by an earlier start" if self.plan_reused else ""
        return (f"placement {self.name} chosen by the planner ({figures} predicted on {self.cores} cores for "
                f"workload {self.workload}, TTFT {self.slo.ttft_s:g} s / TPOT {self.slo.tpot_s:g} s at "
                f"{self.slo.attainment:.0%}; profile {self.profile}{saved})")

    def as_dict(self) -> dict[str, Any]:
        """For ``/health`` (worker counts and cores only for a disaggregated choice)."""
        keys = {"mode": self.mode} if self.mode == "colocated" else self.keys
        return {
            "source": "planner", "chosen": self.name, **keys,
            "predicted_goodput": self.predicted, "candidates": self.candidates, "workload": self.workload,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "attainment": self.slo.attainment},
            "cores": self.cores, "profile": self.profile, "profile_measured": self.profile_measured,
            "profile_measured_under_load": self.profile_under_load, "plan_reused": self.plan_reused,
        }


def pinned_keys(cfg: ServiceConfig) -> list[str]:
    """The placement keys of :data:`PLACEMENT_KEYS` that ``cfg`` was given (file or flags), and
    ``cluster.backend`` when it is ray (its nodes are placed by the config)."""
    given = [key for key in PLACEMENT_KEYS
             if (key.split(".")[-1] in (cfg.compute.model_fields_set if key.startswith("compute.") else cfg.model_fields_set))]
    return given + (["cluster.backend"] if cfg.cluster.backend == "ray" else [])


def usable_cores() -> list[int]:
    """The CPU cores this process may run on, in order (:func:`~mm_serve.cluster.launcher.available_cpus`)."""
    return available_cpus()


def default_profile_dir() -> Path:
    """``$MM_SERVE_PROFILE_DIR``, else ``$MM_SERVE_CACHE_DIR/profiles``, else ``$XDG_CACHE_HOME/mm-serve/profiles``,
    else ``~/.cache/mm-serve/profiles``."""
    if os.environ.get("MM_SERVE_PROFILE_DIR"):
        return Path(os.environ["MM_SERVE_PROFILE_DIR"])
    if os.environ.get("MM_SERVE_CACHE_DIR"):
        return Path(os.environ["MM_SERVE_CACHE_DIR"]) / "profiles"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mm-serve" / "profiles"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parallel_degrees(cores: int, num_heads: int) -> list[int]:
    """The thread counts a profile is measured on beside one thread: the planner's tensor-parallel
    degrees above 1 on ``cores`` devices for a model of ``num_heads`` attention heads (powers of two
    that divide the heads: :func:`mm_serve.planner.candidates.tp_degrees`)."""
    return [degree for degree in tp_degrees(num_heads, cores) if degree > 1]


def profile_key(model_dir: Path, dtype: str, cores: int, degrees: list[int] | None = None) -> str:
    """The cache key of a profile: a digest of the checkpoint's ``config.json``, ``dtype``, the
    CPU model, ``cores``, the torch version, the compiled CPU kernels' sources and flags
    (:func:`~mm_serve.kernels.cpu_extension.build_tag`: a faster kernel is timed again) and the
    sizes measured, ``degrees`` the thread counts beside one (None: :func:`parallel_degrees` of the
    checkpoint; a change of any of them measures again)."""
    import torch

    from mm_serve.kernels.cpu_extension import build_tag

    if degrees is None:
        degrees = parallel_degrees(cores, load_model_shape(str(model_dir)).num_heads)
    sizes = json.dumps({**PROFILE_SIZES, "parallel_threads": degrees}, sort_keys=True)
    try:
        kernels = build_tag()
    except OSError:  # the kernel sources are not installed: the engine runs the torch reference
        kernels = "no-kernel-sources"
    parts = [(model_dir / "config.json").read_bytes(), dtype.encode(), _cpu_model().encode(), str(cores).encode(),
             torch.__version__.encode(), kernels.encode(), sizes.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def measure_watching_load(measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float | None]:
    """The profile ``measure()`` returns and the share of this process's usable cores that other processes
    kept busy meanwhile (:class:`~mm_serve.runtime.core_load.CoreLoad`) when it is over
    :data:`BUSY_SHARE_LIMIT`, else None. Over the limit, the profile carries that share (rounded to
    three places) under :data:`UNDER_LOAD_KEY`."""
    with CoreLoad(usable_cores()) as load:
        profile = measure()
    if load.share is None or load.share <= BUSY_SHARE_LIMIT:
        return profile, None
    profile[UNDER_LOAD_KEY] = share = round(load.share, 3)
    return profile, share


def cached_profile(model_dir: Path, dtype: str, cores: int, profile_dir: Path,
                   log: Callable[[str], None] = print) -> tuple[Path, bool]:
    """The profile file of ``model_dir`` in ``dtype`` on this machine and whether it was measured now
    (False: read from the cache). The cached file carries the checkpoint's ``config.json`` itself, not
    its path: the cache is keyed by that file's digest and shared by every copy of the checkpoint (an
    older file naming a path that is gone, like one that is not a valid profile, is measured again).
    A profile measured while other processes kept more than :data:`BUSY_SHARE_LIMIT` of this process's
    cores busy (:class:`~mm_serve.runtime.core_load.CoreLoad`) is used, marked with that share under
    :data:`UNDER_LOAD_KEY`, and measured again at the next start instead of being read. Each point is the
    median of 3 passes, so one slow pass (a neighbour's burst) does not move it (as the mean of 2 did);
    the third pass adds little to the ~30 s of a profile of bench-llama, most of it the decode points'
    prefills.

    Raises:
        PlannerError: the profile folder cannot be written (checked before measuring), or the
            checkpoint cannot be profiled (the message says why).
        CheckpointError: the checkpoint cannot be loaded (its weights or tokenizer).
    """
    degrees = parallel_degrees(cores, load_model_shape(str(model_dir)).num_heads)
    path = profile_dir / f"{model_dir.name}-{profile_key(model_dir, dtype, cores, degrees)}.json"
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            parse_profile(cached, path.parent, str(path))
            busy = cached.get(UNDER_LOAD_KEY)
            if not isinstance(busy, (int, float)):
                return path, False
            log(f"the cached profile {path} was measured while other processes kept {busy:.0%} of its cores busy: "
                "measuring again")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ProfileError):
            log(f"the cached profile {path} is unreadable: measuring again")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)  # one per process
        os.close(fd)
    except OSError as exc:
        raise PlannerError(f"cannot write profiles to {path.parent}: {exc.strerror} (set placement.profile_dir "
                           "or $MM_SERVE_PROFILE_DIR to a writable folder)") from None
    import torch

    from mm_serve.planner.profiler import measure_profile
    from mm_serve.runtime.malloc_tuning import release_free_heap

    log(f"profiling this machine for the placement (once; cached at {path}; delete it to measure again) ...")
    threads = torch.get_num_threads()
    try:
        profile, share = measure_watching_load(lambda: measure_profile(
            model_dir, threads=1, repeats=3, log=lambda line: log(f"  {line}"), dtype=dtype,
            parallel_threads=degrees, **PROFILE_SIZES))  # type: ignore[arg-type]
        if share is not None:  # what the next start reads and prints
            log(f"other processes kept {share:.0%} of this process's cores busy while profiling (over "
                f"{BUSY_SHARE_LIMIT:.0%}): the placement uses this profile now, and the next start measures again")
        profile["cache_key"] = path.stem
        profile["model"] = json.loads((model_dir / "config.json").read_text())  # not a path: any copy reads it
        Path(tmp).write_text(json.dumps(profile, indent=2))
        os.replace(tmp, path)
    except CheckpointError:  # the checkpoint cannot be served at all: the caller's error, not the planner's
        raise
    except ValueError as exc:
        raise PlannerError(f"cannot profile {model_dir}: {exc}") from None
    finally:
        torch.set_num_threads(threads)
        Path(tmp).unlink(missing_ok=True)
        gc.collect()  # the profiled engine's weights and KV cache ...
        release_free_heap()  # ... back to the system: this process (the API server) keeps running
    return path, True


def choose_placement(
    cfg: ServiceConfig, model_dir: Path, profile: Path, cores: list[int], measured: bool = False,
) -> PlacementChoice:
    """Ask the planner which placement of ``model_dir`` serves ``cfg``'s default tier best on ``cores``.

    Raises:
        PlannerError, WorkloadError, ProfileError: the planner cannot plan this model, workload or profile.
    """
    shape = load_model_shape(str(model_dir))
    workload_name = cfg.placement.workload
    if workload_name == "auto":
        workload_name = "llava" if shape.image_tokens else "chatbot"
    tier_slo = cfg.slo.of(cfg.slo.default)
    spec = PlanSpec(
        shape=shape, hardware=get_hardware(str(profile)),
        workload=make_workload(workload_name, shape.image_tokens, shape.max_context),
        slo=SLO(tier_slo.ttft_s, tier_slo.tpot_s), attainment=tier_slo.attainment, nodes=1,
        gpus_per_node=len(cores), seed=cfg.seed, prefill_token_budget=cfg.scheduler.prefill_token_budget,
        prefill_max_batch=cfg.scheduler.prefill_batch_size, decode_max_batch=cfg.scheduler.decode_max_concurrent,
        colocated_mixed_tokens=cfg.scheduler.mixed_step_tokens, page_size=cfg.kv_cache.page_size,
        front_end_s_per_token=cfg.placement.front_end_ms_per_token / 1000,
    )
    # every plain field of the spec (a field added later is in the key without being named here); the model
    # shape and hardware are keyed by config.json and the profile's bytes, the workload by its name
    inputs: dict[str, Any] = {f.name: value for f in dataclasses.fields(spec)
                              if isinstance(value := getattr(spec, f.name), (bool, int, float, str))}
    inputs |= {"workload": workload_name, "slo": dataclasses.astuple(spec.slo), "cores": list(cores),
               "worker_nice": cfg.compute.worker_nice, "pacing_given": _pacing_given(cfg)}
    profile_bytes = profile.read_bytes()  # the file get_hardware read above
    saved = _plan_path(profile, profile_bytes, model_dir, inputs)
    cached = _read_choice(saved, measured)
    if cached is not None:
        return cached
    start = time.perf_counter()
    evaluator = GoodputEvaluator(spec)
    # the colocated mode runs one worker on every core: that instance's goodput is compared, not the
    # planner's best colocated pool (which may be several smaller instances the service does not run)
    result = plan(spec, evaluator, colocated_pool=False)
    colocated = ParallelConfig(max(tp_degrees(shape.num_heads, len(cores))), 1)
    colocated_rate = evaluator.colocated_goodput(colocated, False)
    shared: tuple[SharedCorePlacement, float] | None = None
    nice = min(19, cfg.compute.worker_nice + SHARED_NICE_STEP)
    if not _pacing_given(cfg):
        share = cfs_share(cfg.compute.worker_nice, nice)
        placements = [SharedCorePlacement(len(cores), pacing) for pacing in PACINGS]
        rates = [evaluator.shared_core_goodput(placement, share) for placement in placements]
        best = max(rates)
        shared = (placements[rates.index(best)], best)  # the first of equals: the least paced
    under_load = json.loads(profile_bytes).get(UNDER_LOAD_KEY)
    choice = _choice(result, cores, workload_name, tier_slo, str(profile), measured, colocated, colocated_rate,
                     shared, nice, time.perf_counter() - start,
                     under_load if isinstance(under_load, (int, float)) else None)
    if choice.profile_under_load is None:  # the next start measures a loaded profile again: no start reads it
        _write_choice(saved, choice)
    return choice


@functools.lru_cache(maxsize=1)
def _planner_source_digest() -> str:
    """A digest of the planner's and the workloads' source: a plan saved by other code is not reused."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted([*here.glob("*.py"), *(here.parent / "workloads").glob("*.py")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _plan_path(profile: Path, profile_bytes: bytes, model_dir: Path, inputs: dict[str, Any]) -> Path:
    """Where the choice for ``inputs`` on ``profile`` (whose content is ``profile_bytes``) is saved, beside
    the profile: named by a digest of the inputs, the profile, the checkpoint's ``config.json`` and the
    planner's source."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    digest.update(profile_bytes)
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    digest.update(_planner_source_digest().encode())
    return profile.parent / f"{profile.stem}.plan-{digest.hexdigest()[:16]}.json"


def _read_choice(path: Path, measured: bool) -> PlacementChoice | None:
    """The choice saved at ``path`` (None: none, or unreadable: planned again)."""
    try:
        saved = json.loads(path.read_text())
        shared = saved.pop("shared_core")
        choice = PlacementChoice(**{**saved, "slo": SLO(*saved["slo"]), "profile_measured": measured,
                                    "plan_reused": True, "shared_core": SharedCorePlacement(**shared) if shared else None})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: the last the pruning removes
    return choice


def _write_choice(path: Path, choice: PlacementChoice) -> None:
    """Save ``choice`` at ``path`` (atomically; a cache that cannot be written is skipped)."""
    fields = {name: getattr(choice, name) for name in PlacementChoice.__dataclass_fields__ if name != "plan_reused"}
    fields["slo"] = [choice.slo.ttft_s, choice.slo.tpot_s, choice.slo.attainment]
    fields["shared_core"] = None if choice.shared_core is None else {"cores": choice.shared_core.cores,
                                                                     "pacing": choice.shared_core.pacing}
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump(fields, out)
        os.replace(out.name, path)
    except OSError:
        return
    _prune_plans(path)


def _prune_plans(path: Path) -> None:
    """Keep the :data:`PLANS_KEPT` plans used last among those saved beside ``path``'s profile, deleting the
    others (those of older profiles, SLOs and planner versions would otherwise pile up there)."""
    stem = path.name.split(".plan-")[0]
    saved = []
    for saved_plan in path.parent.glob(f"{glob.escape(stem)}.plan-*.json"):
        with contextlib.suppress(OSError):
            saved.append((saved_plan.stat().st_mtime, saved_plan))
    for _, old in sorted(saved, reverse=True)[PLANS_KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _pacing_given(cfg: ServiceConfig) -> bool:
    """Whether ``cfg`` sets the decode pacing or the shared-core niceness itself (file or flags):
    the planner then does not offer a shared core, whose rules would override them."""
    return bool({"decode_step_pacing", "decode_step_interval_ms"} & cfg.scheduler.model_fields_set
                or "prefill_worker_nice" in cfg.compute.model_fields_set)


def _choice(result: PlanResult, cores: list[int], workload: str, slo: SLO, profile: str,
            measured: bool, colocated: ParallelConfig, colocated_rate: float,
            shared: tuple[SharedCorePlacement, float] | None, shared_nice: int, seconds: float,
            under_load: float | None) -> PlacementChoice:
    """The choice from a plan, the goodput (requests/s) of the colocated instance the service would run
    (``colocated``) and of the best shared-core placement (``shared``, None: not offered): the one
    predicting the most, the simpler on a tie (colocated, then the planner's unit, then a shared core)."""
    prefill = [i for i in result.placement if i.role == "prefill"]
    decode = [i for i in result.placement if i.role == "decode"]
    disaggregated = f"{len(prefill)}P+{len(decode)}D"
    predicted = {"colocated": colocated_rate, disaggregated: result.cluster_goodput}
    candidates = {"colocated": f"one worker on cores {cores} (planned as one TP{colocated.tp} PP{colocated.pp} instance)"}
    prefill_cpus = [cores[g] for i in prefill for g in i.gpus]
    decode_cpus = [cores[g] for i in decode for g in i.gpus]
    candidates[disaggregated] = f"prefill on cores {prefill_cpus}, decode on cores {decode_cpus}"
    if shared is not None:
        placement, rate = shared
        predicted[placement.name] = rate
        paced = f"steps paced at {placement.pacing:g} x the TPOT SLO" if placement.pacing else "steps unpaced"
        candidates[placement.name] = (f"prefill on cores {cores}, decode on core {cores[-1]} beside a prefill worker "
                                      f"niced to {shared_nice}, {paced}")
    common = {"predicted": predicted, "workload": workload, "slo": slo, "cores": len(cores), "profile": profile,
              "profile_measured": measured, "seconds": seconds, "candidates": candidates,
              "profile_under_load": under_load}
    best = max(predicted.values())
    if colocated_rate >= best:
        return PlacementChoice("colocated", 1, 1, [], [], **common)  # type: ignore[arg-type]
    if result.cluster_goodput >= best or shared is None:
        return PlacementChoice("disaggregated", len(prefill), len(decode), prefill_cpus, decode_cpus,
                               **common)  # type: ignore[arg-type]
    return PlacementChoice("disaggregated", len(cores), 1, list(cores), [cores[-1]], **common,  # type: ignore[arg-type]
                           shared_core=shared[0], prefill_worker_nice=shared_nice)


def apply_placement(
    cfg: ServiceConfig, mode: str, prefill_workers: int = 1, decode_workers: int = 1,
    prefill_cpus: list[int] | None = None, decode_cpus: list[int] | None = None,
    decode_step_pacing: float | None = None, prefill_worker_nice: int | None = None,
) -> ServiceConfig:
    """``cfg`` with this mode, worker counts and cores (none given: unpinned), and, where given, the
    decode pacing (``scheduler.decode_step_pacing``) and the niceness of a prefill worker sharing a
    decode worker's core (``compute.prefill_worker_nice``), validated again.

    Raises:
        ConfigError: the result does not validate (e.g. more workers than the config allows).
    """
    tree = cfg.model_dump(mode="json")
    tree["mode"] = mode
    tree["compute"].update(prefill_workers=prefill_workers, decode_workers=decode_workers,
                           prefill_cpus=prefill_cpus or [], decode_cpus=decode_cpus or [])
    if decode_step_pacing is not None:
        tree["scheduler"]["decode_step_pacing"] = decode_step_pacing
    if prefill_worker_nice is not None:
        tree["compute"]["prefill_worker_nice"] = prefill_worker_nice
    return config_from_dict(tree)
