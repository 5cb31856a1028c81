"""Render a :class:`PlanResult` as text for people or as one JSON object for tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mm_serve.planner.placement import InstancePlacement
from mm_serve.planner.search import PlanResult
from mm_serve.planner.vision_shape import VisionShape


def _gpus(ids: Sequence[int]) -> str:
    """Compact GPU list: runs of consecutive ids as ``a-b``."""
    parts, start = [], None
    for i, g in enumerate(ids):
        if start is None:
            start = g
        if i + 1 == len(ids) or ids[i + 1] != g + 1:
            parts.append(str(start) if start == g else f"{start}-{g}")
            start = None
    return ",".join(parts)


def instance_dict(inst: InstancePlacement) -> dict[str, Any]:
    """One placement entry: role, tp, pp, GPU count and ids, nodes."""
    return {"role": inst.role, "tp": inst.par.tp, "pp": inst.par.pp, "num_gpus": inst.par.gpus,
            "gpus": list(inst.gpus), "nodes": list(inst.nodes)}


def plan_dict(result: PlanResult) -> dict[str, Any]:
    """The ``--json`` object. Rates in requests/s, per-GPU rates in requests/s/GPU."""
    spec, unit = result.spec, result.unit
    col = result.colocated
    return {
        "model": spec.shape.name,
        "hardware": spec.hardware.name,
        "workload": spec.workload.name,
        "slo_ttft_s": spec.slo.ttft_s,
        "slo_tpot_s": spec.slo.tpot_s,
        "attainment": spec.attainment,
        "image_tokens": spec.shape.image_tokens,
        "tower_passes_per_image": spec.shape.vision.tiles_per_image if spec.shape.vision else 0,
        "nodes": spec.nodes,
        "gpus_per_node": spec.gpus_per_node,
        "affinity": spec.affinity,
        "front_end_ms_per_token": spec.front_end_s_per_token * 1000,
        "per_gpu_goodput": result.per_gpu_goodput,
        "colocated_per_gpu_goodput": result.colocated_per_gpu_goodput,
        "disaggregated_over_colocated": result.ratio if col else None,
        "unit": {
            "prefill": {"instances": unit.num_prefill, "tp": unit.prefill.tp, "pp": unit.prefill.pp,
                        "goodput_each": result.prefill.goodput},
            "decode": {"instances": unit.num_decode, "tp": unit.decode.tp, "pp": unit.decode.pp,
                       "goodput_each": result.decode.goodput},
            "gpus": unit.gpus,
            "goodput": result.unit_goodput,
            "estimated_goodput": result.estimated_unit_goodput,
        },
        "units": result.units,
        "gpus_used": result.gpus_used,
        "cluster_goodput": result.cluster_goodput,
        "placement": [instance_dict(i) for i in result.placement],
        "colocated": None if col is None else {
            "tp": col.par.tp, "pp": col.par.pp, "goodput_each": col.goodput,
            "instances_simulated": result.colocated_unit_instances,
            "goodput_simulated": result.colocated_unit_goodput,
            "instances_in_cluster": len(result.colocated_placement),
        },
        # every unit simulated whole, in the phase estimate's order; the chosen one is the best per GPU
        "shortlist": [{"prefill": {"instances": u.num_prefill, "tp": u.prefill.tp, "pp": u.prefill.pp},
                       "decode": {"instances": u.num_decode, "tp": u.decode.tp, "pp": u.decode.pp},
                       "gpus": u.gpus, "goodput": goodput, "per_gpu_goodput": goodput / u.gpus}
                      for u, goodput in result.shortlisted],
        "simulations": result.simulations,
        "search_seconds": result.seconds,
    }


def _image_line(vision: VisionShape | None) -> list[str]:
    """How each image is planned, for a model with a tower; a tiling family's at its costliest."""
    if vision is None:
        return []
    if vision.tiles_per_image == 1:
        return [f"Images: {vision.image_tokens} tokens and one tower pass each"]
    return [f"Images: planned at the most one costs, {vision.image_tokens} tokens and "
            f"{vision.tiles_per_image} tower passes each (the largest tile grid plus the whole image)"]


def plan_text(result: PlanResult, device: str = "GPU") -> str:
    """Human-readable summary: placement table, goodputs, colocated comparison. ``device``: what one planned
    device is called (``GPU``; ``core`` for a CPU plan, whose devices are one-thread worker slots)."""
    spec, unit = result.spec, result.unit

    def count(n: int) -> str:
        return f"{n} {device}{'' if n == 1 else 's'}"

    lines = [
        f"Placement for {spec.shape.name} on {spec.nodes} x {spec.gpus_per_node} "
        f"{spec.hardware.name} (affinity {spec.affinity}), workload {spec.workload.name}, "
        f"SLO TTFT {spec.slo.ttft_s:g} s / TPOT {spec.slo.tpot_s:g} s at {spec.attainment:.0%}",
        *_image_line(spec.shape.vision),
        *([f"Front end: {spec.front_end_s_per_token * 1000:g} ms of CPU per streamed token, priced into each step "
           "of an instance on several threads"] if spec.front_end_s_per_token else []),
        f"Unit: {unit.num_prefill} prefill x {unit.prefill} + {unit.num_decode} decode x "
        f"{unit.decode} = {count(unit.gpus)}, {result.unit_goodput:.2f} req/s "
        f"(phase estimate {result.estimated_unit_goodput:.2f}); replicated {result.units}x",
        "",
        f"  {'role':<8} {'tp':>3} {'pp':>3} {device.lower() + 's':>5}  {'nodes':<8} {device.lower()} ids",
    ]
    for inst in result.placement:
        nodes = ",".join(str(n) for n in inst.nodes)
        lines.append(f"  {inst.role:<8} {inst.par.tp:>3} {inst.par.pp:>3} {inst.par.gpus:>5}  "
                     f"{nodes:<8} {_gpus(inst.gpus)}")
    lines += [
        "",
        f"{'Per-' + device + ' goodput:':<19}{result.per_gpu_goodput:.3f} req/s/{device} "
        f"(cluster {result.cluster_goodput:.1f} req/s on {count(result.gpus_used)})",
    ]
    col = result.colocated
    if col is None:
        lines.append("Colocated best:    none meets the SLOs")
    else:
        lines.append(
            f"{'Colocated best:':<19}{result.colocated_per_gpu_goodput:.3f} req/s/{device} "
            f"({col.par}, {result.colocated_unit_instances} "
            f"{'instance' if result.colocated_unit_instances == 1 else 'instances simulated together'}; "
            + (f"mixed steps of {spec.colocated_mixed_tokens} tokens)" if spec.colocated_mixed_tokens
               else "prefill and decode steps apart)"))
        lines.append(f"Disaggregated / colocated: {result.ratio:.2f}x")
        if result.ratio < 1:
            lines.append("Note: colocated serving beats this disaggregated placement for these "
                         "SLOs; prefer mode: colocated.")
    lines.append(f"Search: {result.simulations} simulations in {result.seconds:.1f} s")
    return "\n".join(lines)
