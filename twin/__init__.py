"""Digital twin of one multi-LoRA vLLM V1 server (workload model, profiles, simulator)."""

from twin.errors import BadInputError, InfeasibleError, LoraPlannerError, ProfileError, WorkloadError
from twin.profile import DEFAULT_PROFILE_ID, Profile, list_profiles, load_profile, recorded_profile
from twin.simulate import SimConfig, SimResult, simulate
from twin.workload import (
    Adapter,
    Conversations,
    LengthModel,
    PoissonArrivals,
    Requests,
    UnpredictableArrivals,
    Workload,
    draw_requests,
    trace_requests,
)

__all__ = [
    "DEFAULT_PROFILE_ID",
    "Adapter",
    "BadInputError",
    "Conversations",
    "InfeasibleError",
    "LengthModel",
    "LoraPlannerError",
    "PoissonArrivals",
    "Profile",
    "ProfileError",
    "Requests",
    "SimConfig",
    "SimResult",
    "UnpredictableArrivals",
    "Workload",
    "WorkloadError",
    "draw_requests",
    "list_profiles",
    "load_profile",
    "recorded_profile",
    "simulate",
    "trace_requests",
]
