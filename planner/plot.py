"""``--plot``: each GPU's load and throughput, and its p99 TTFT against the SLO, with each GPU's --max-loras."""

from __future__ import annotations

import io
import os

from planner.placement import Placement
from twin.atomic import write_bytes_atomic
from twin.errors import BadInputError


def plot_placement(p: Placement, path: str | os.PathLike) -> None:
    """Top: arriving tok/s and the plan's throughput per GPU; bottom (a plan judged in the twin): p99 TTFT
    on a log scale against each GPU's limit. Legends sit below their axes, clear of the bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install 'lora-planner[plot]'") from None
    insts = p.instances
    judged = all(i.twin is not None for i in insts) and bool(insts)
    names = [i.instance_id for i in insts]
    x = range(len(names))
    width = max(7.0, 0.6 * len(names) + 2)
    fig, axes = plt.subplots(2 if judged else 1, 1, figsize=(width, 7.5 if judged else 4.5), squeeze=False,
                             sharex=True)
    ax = axes[0][0]
    arriving = [i.arriving_tok_s for i in insts]
    throughput = [i.predicted_throughput_tok_s or 0.0 for i in insts]
    ax.bar([k - 0.2 for k in x], arriving, 0.4, label="arriving tok/s", color="#9ab")
    ax.bar([k + 0.2 for k in x], throughput, 0.4, color="#357",
           label="throughput tok/s in the twin" if judged else "predicted throughput tok/s")
    ax.plot([k - 0.4 for k in x], [0.9 * a for a in arriving], "r_", markersize=14,
            label="starvation line (0.9 x arriving)")
    for k, inst in enumerate(insts):
        mark = "" if inst.ok else (" MEM" if not inst.memory_ok else " FAILS")
        ax.annotate(f"A_max {inst.a_max}\n{len(inst.adapters)} ad.{mark}", (k, max(arriving[k], throughput[k])),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.margins(y=0.25)
    ax.set_title(f"{p.inputs['algorithm']} plan on {p.inputs['profile_id']}: {len(names)} GPU(s)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08 if judged else -0.15), ncol=3,
              frameon=False)
    if judged:
        lat = axes[1][0]
        ttft = [max(i.twin["ttft_ms_p99"] or 0.0, 1.0) / 1000.0 for i in insts]
        colors = ["#357" if i.twin["meets"] else "#c33" for i in insts]
        lat.bar(list(x), ttft, 0.6, color=colors, label="p99 TTFT in the twin (red: over its limit)")
        limits = [i.twin["max_ttft_ms"] for i in insts]
        if any(v is not None for v in limits):
            lat.plot(list(x), [v / 1000.0 if v is not None else float("nan") for v in limits], "k_", markersize=22,
                     mew=2, label="the GPU's p99 TTFT limit (SLO)")
        lat.set_yscale("log")
        lat.set_ylabel("p99 time to first token (s)")
        lat.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    bottom = axes[-1][0]
    bottom.set_xticks(list(x), names, rotation=45 if len(names) > 8 else 0)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
