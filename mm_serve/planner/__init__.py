"""Placement planner and simulator behind ``mm-serve plan`` (DistServe §3-§4, pure Python).

Layers, bottom up: :mod:`model_shape` / :mod:`hardware` (what is served, on what),
:mod:`work` and :mod:`latency_model` (roofline times per phase and parallel config),
:mod:`fit` (coefficients from a measured profile; :func:`get_hardware` picks a built-in
or a fitted device), the discrete-event simulator (:mod:`simulator` and the instance
modules, :mod:`sim_result` for a run's SLO attainment), :mod:`goodput` (max rate meeting
the SLO attainment), and :mod:`search` (DistServe Algorithms 1 and 2). The simulated
requests are drawn from :mod:`mm_serve.workloads` (the ones ``mm-serve bench`` sends);
SLOs are :class:`mm_serve.ground.slo.SLO`, every latency in seconds. See
``docs/planner.md`` for the equations and an example.
"""

from mm_serve.planner.errors import HardwareError, ModelShapeError, PlannerError, ProfileError
from mm_serve.planner.fit import ProfileFit, fit_profile, fit_profile_file, get_hardware
from mm_serve.planner.hardware import Hardware, PhaseCoefficients, hardware_names
from mm_serve.planner.latency_model import LatencyModel, ParallelConfig
from mm_serve.planner.model_shape import ModelShape, load_model_shape, shape_from_config
from mm_serve.planner.plan_spec import PlanSpec
from mm_serve.planner.search import PlanResult, plan
from mm_serve.planner.sim_result import SimResult

__all__ = [
    "Hardware",
    "HardwareError",
    "LatencyModel",
    "ModelShape",
    "ModelShapeError",
    "ParallelConfig",
    "PhaseCoefficients",
    "PlanResult",
    "PlanSpec",
    "PlannerError",
    "ProfileError",
    "ProfileFit",
    "SimResult",
    "fit_profile",
    "fit_profile_file",
    "get_hardware",
    "hardware_names",
    "load_model_shape",
    "plan",
    "shape_from_config",
]
