"""Which models a fleet's traffic names are adapters to plan, and their ranks: the rule of ``planner workload``.

Ranks are not in logs or counters: ``--ranks`` names them, ``--default-rank`` covers the rest. Traffic also
holds the base model's own requests, and a default rank would plan the base model as one more adapter; so
``--default-rank`` needs ``--base-model``: the base model's name (its requests are left out), or ``none``
(the traffic names adapters only). A model with no rank is refused when it is first met, naming where.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from planner.workload_csv import adapter_id_problem, read_ranks
from twin.errors import BadInputError

#: A name that looks like a base model's: a parameter count (8B, 0.5b, 70B) or a model maker's namespace.
BASE_LIKE = re.compile(r"(^|[-_/.:])\d+(\.\d+)?[bB]([-_/.:]|$)|^(meta-llama|mistralai|qwen|google|microsoft|"
                       r"deepseek-ai|ibm-granite|nvidia|tiiuae|openai)/", re.IGNORECASE)


@dataclass(frozen=True)
class Ranks:
    """adapter id -> (rank, path) from ``--ranks``, the ``--default-rank`` (None: none) and the base model's
    name (None: the traffic holds adapters only)."""

    named: dict[str, tuple[int, str | None]]
    default: int | None
    base_model: str | None

    @classmethod
    def from_options(cls, ranks_file, default_rank: int | None, base_model: str | None) -> Ranks:
        """The options checked together, before any traffic is read."""
        if default_rank is not None and base_model is None:
            raise BadInputError("--default-rank would plan every model the traffic names without a rank in --ranks, "
                                "the base model's requests too, as an adapter of that rank: name the base model with "
                                "--base-model NAME (its requests are left out), or give --base-model none if the "
                                "traffic names adapters only")
        if base_model is not None and not base_model.strip():
            raise BadInputError("--base-model is empty; give the base model's name as the traffic names it, or none")
        named = {} if ranks_file is None else read_ranks(ranks_file)
        return cls(named, default_rank, None if base_model == "none" else base_model)

    def excluded(self, name: str) -> bool:
        """Whether ``name``'s requests are left out (the base model's)."""
        return name == self.base_model

    def problem(self, name: str) -> str | None:
        """Why ``name`` (not the base model) cannot be planned as an adapter (None: it can)."""
        bad = adapter_id_problem(name)
        if bad:
            return (bad if bad.startswith("'") else f"the model {bad}") + (
                "" if self.base_model else "; leave the base model's requests out with --base-model NAME")
        if name in self.named or self.default is not None:
            return None
        hint = (f"; it looks like a base model: leave its requests out with --base-model {name}"
                if BASE_LIKE.search(name) and self.base_model is None else "")
        return f"no rank for the adapter '{name}': name it in --ranks or give --default-rank{hint}"

    def rank_of(self, name: str) -> tuple[int, str | None]:
        """The rank and path of an adapter :meth:`problem` passed."""
        return self.named.get(name, (self.default, None))
