"""Write the strict JSON schemas of the core kinds `planner render` writes, each self-contained.

Usage: python tests/data/k8s/subset.py DIR, where DIR is ``kubernetes-json-schema/vX.Y.Z-local-strict`` of
the ``kubernetes-validate`` wheel (``pip download --no-deps kubernetes-validate==1.37.0``, unzipped); writes
``tests/data/k8s/vX.Y.Z/``. Each kind keeps only the definitions it reaches (``$ref`` made local), without
their descriptions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = ("deployment-apps-v1", "service-v1")


def _local(node, defs: dict, keep: dict):
    """``node`` with every ``$ref`` into ``_definitions.json`` made local, collecting what it reaches in ``keep``."""
    if isinstance(node, list):
        return [_local(v, defs, keep) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref":
            name = v.rsplit("/", 1)[-1]
            out[k] = f"#/$defs/{name}"
            if name not in keep:
                keep[name] = None
                keep[name] = _local(defs[name], defs, keep)
        elif k != "description" or not isinstance(v, str):
            out[k] = _local(v, defs, keep)
    return out


def main(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    defs = json.loads((src / "_definitions.json").read_text())["$defs"]
    for kind in KINDS:
        keep: dict = {}
        schema = _local(json.loads((src / f"{kind}.json").read_text()), defs, keep)
        schema.pop("$id", None)
        schema["$defs"] = dict(sorted(keep.items()))
        (dst / f"{kind}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).parent / Path(sys.argv[1]).name.split("-")[0])
