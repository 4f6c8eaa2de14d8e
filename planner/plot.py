"""``--plot``: per-GPU arriving load vs predicted throughput, with each GPU's --max-loras."""

from __future__ import annotations

import io
import os

from planner.placement import Placement
from twin.atomic import write_bytes_atomic
from twin.errors import BadInputError


def plot_placement(p: Placement, path: str | os.PathLike) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install 'lora-planner[plot]'") from None
    names = [i.instance_id for i in p.instances]
    arriving = [i.arriving_tok_s for i in p.instances]
    predicted = [i.predicted_throughput_tok_s or 0.0 for i in p.instances]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(names) + 2), 4))
    ax.bar([k - 0.2 for k in x], arriving, 0.4, label="arriving tok/s", color="#9ab")
    ax.bar([k + 0.2 for k in x], predicted, 0.4, label="predicted throughput tok/s", color="#357")
    ax.plot([k - 0.4 for k in x], [0.9 * a for a in arriving], "r_", markersize=14, label="starvation line (0.9 x arriving)")
    for k, inst in enumerate(p.instances):
        mark = "" if inst.ok else (" MEM" if not inst.memory_ok else " STARVES")
        ax.annotate(f"A_max {inst.a_max}\n{len(inst.adapters)} ad.{mark}", (k, max(arriving[k], predicted[k])),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=45 if len(names) > 8 else 0)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{p.inputs['algorithm']} plan on {p.inputs['profile_id']}: {len(names)} GPU(s)")
    ax.legend(fontsize=8, loc="lower right")
    ax.margins(y=0.2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
