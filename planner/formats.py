"""Every output format of a placement, by name (``--format``)."""

from __future__ import annotations

import json

from planner.manifests import manifests, to_yaml
from planner.placement import Placement
from planner.render import render_changes, render_table, render_vllm
from twin.errors import BadInputError

FORMATS = ("table", "json", "vllm", "k8s", "llm-d", "aibrix")


def render(p: Placement, fmt: str, model: str, port_base: int = 8000, adapter_dir: str | None = None,
           image: str | None = None, name: str = "lora") -> str:
    """A placement as ``fmt``: the table (with a re-plan's changes), the placement JSON, vLLM commands, or
    Kubernetes manifests (planner.manifests; ``adapter_dir`` then a path inside the container)."""
    if fmt == "json":
        return json.dumps(p.to_dict(), indent=1, allow_nan=False)
    if fmt == "vllm":
        return render_vllm(p, model, port_base, adapter_dir or "adapters")
    if fmt in ("k8s", "llm-d", "aibrix"):
        return to_yaml(manifests(p, fmt, image or "vllm/vllm-openai:latest", model, adapter_dir or "/adapters", name))
    if fmt != "table":
        raise BadInputError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)}")
    return render_table(p) + ("\n" + render_changes(p) if p.changes else "")
