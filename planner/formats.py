"""Every output format of a placement, by name (``--format``)."""

from __future__ import annotations

import json
import re

from planner.manifests import render_manifests
from planner.placement import Placement
from planner.render import render_changes, render_table, render_vllm
from twin.errors import BadInputError

FORMATS = ("table", "json", "vllm", "k8s", "llm-d", "aibrix")
#: The formats that start vLLM servers, and so name the model they load.
LAUNCH_FORMATS = ("vllm", "k8s", "llm-d", "aibrix")
#: A Hugging Face model id, ``org/name``.
HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def launch_model(fmt: str, model: str | None, profile_model: dict) -> str | None:
    """The ``--model`` a launch format writes: the one given, else the profile's Hugging Face id (its model's
    ``hf_id``); without either it is refused, never a bare name vLLM cannot load."""
    if model or fmt not in LAUNCH_FORMATS:
        return model
    if HF_ID.fullmatch(str(profile_model.get("hf_id", ""))):
        return profile_model["hf_id"]
    name = profile_model.get("name")
    raise BadInputError(f"--format {fmt} needs --model: a Hugging Face id (org/name) or a path vLLM can load (the "
                        f"profile records no Hugging Face id for its model{f' {name!r}' if name else ''})")


def render(p: Placement, fmt: str, model: str, port_base: int = 8000, adapter_dir: str | None = None,
           image: str | dict[str, str] | None = None, name: str = "lora") -> str:
    """A placement as ``fmt``: the table (with a re-plan's changes), the placement JSON, vLLM commands, or
    Kubernetes manifests (planner.manifests; ``adapter_dir`` then a path inside the container, ``image`` one or
    one per pool kind, required)."""
    if fmt == "json":
        return json.dumps(p.to_dict(), indent=1, allow_nan=False)
    if fmt == "vllm":
        return render_vllm(p, model, port_base, adapter_dir or "adapters")
    if fmt in ("k8s", "llm-d", "aibrix"):
        if not image:  # no default here: the image must match the device and the vLLM release the plan was made for
            raise BadInputError(f"{fmt} manifests need a container image (image=): vLLM's image of the profile's "
                                "release, built for the plan's device")
        return render_manifests(p, fmt, image, model, adapter_dir or "/adapters", name)
    if fmt != "table":
        raise BadInputError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)}")
    return render_table(p) + ("\n" + render_changes(p) if p.changes else "")
