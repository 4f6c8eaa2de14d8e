"""Predictor backends by name, and the one a profile gets by default.

* ``twin`` — runs the digital twin on each scenario (:mod:`models.twin_predictor`; slow, exact; for checks
  and where no surrogate is trained for a profile and policy);
* ``surrogate`` — the compiled random forests of ``artifacts/surrogates/<profile-id>/``
  (:mod:`models.surrogate`; a non-stock serving policy has its own subdirectory);
* ``small-tree`` — the distilled trees of at most 32 rules from the same artifact.

Every predictor answers for one serving policy (``policy``: a :class:`twin.policies.PolicySpec`,
None for stock vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

from models.scenario import Predictor
from models.surrogate import SurrogatePredictor, artifact_dir, has_artifact
from models.twin_predictor import TwinPredictor
from twin.errors import BadInputError
from twin.policies.spec import PolicySpec
from twin.profile import Profile

PredictorFactory = Callable[[Profile, PolicySpec | None], Predictor]


def _surrogate(kind: str) -> PredictorFactory:
    def factory(profile: Profile, policy: PolicySpec | None) -> Predictor:
        return SurrogatePredictor(profile, kind, policy=policy)

    return factory


def _twin(profile: Profile, policy: PolicySpec | None) -> Predictor:
    return TwinPredictor(profile, policy=policy)


_BACKENDS: dict[str, PredictorFactory] = {
    "twin": _twin, "surrogate": _surrogate("surrogate"), "small-tree": _surrogate("small-tree"),
}


def predictor_names() -> list[str]:
    return sorted(_BACKENDS)


def load_predictor(profile: Profile, kind: str = "twin", policy: PolicySpec | None = None) -> Predictor:
    try:
        factory = _BACKENDS[kind]
    except KeyError:
        raise BadInputError(f"unknown predictor '{kind}'; choose one of {', '.join(predictor_names())}") from None
    return factory(profile, policy)


def default_predictor(profile: Profile, policy: PolicySpec | None = None) -> Predictor:
    """The ``surrogate`` when an artifact for this profile and policy ships, else the ``twin``. An artifact
    that is there but damaged, or made for another version of the profile, is an error (ProfileError naming
    the file and the command that rebuilds it), never a silent fall back to the slower twin."""
    if not has_artifact(profile, artifact_dir(profile, None, policy)):
        return load_predictor(profile, "twin", policy)
    return load_predictor(profile, "surrogate", policy)
