"""workload.csv validation: one clear line per problem, exit code 2, nothing written."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.workload_csv import read_workload
from twin import WorkloadError, load_profile

GOOD = "adapter_id,rank,rate_rps\na,8,0.5\nb,16,0.25\n"


def write(tmp_path, text, name="w.csv", raw=None):
    p = tmp_path / name
    p.write_bytes(raw if raw is not None else text.encode())
    return p


def test_reads_a_good_workload_with_optional_columns(tmp_path):
    p = write(tmp_path, "adapter_id,rank,rate_rps,input_tokens,output_tokens,path\nx,8,1.5,100,20,/m/x\ny,32,0,,,\n")
    wl = read_workload(p, load_profile("h100-64gb-qwen2.5-7b"))
    assert [a.adapter_id for a in wl.adapters] == ["x", "y"]
    assert wl.adapters[0].input_tokens == 100 and wl.adapters[1].input_tokens is None
    assert wl.adapters[0].path == "/m/x"


@pytest.mark.parametrize("text,expect", [
    ("adapter_id,rate_rps\na,1\n", ":1: column 'rank': missing from the header"),
    ("adapter_id,rank,rate_rps,colour\na,8,1,red\n", ":1: column 'colour': not a workload column"),
    ("adapter_id,rank,rate_rps\na,8,1\na,8,2\n", ":3: column 'adapter_id': 'a' already appears on line 2"),
    ("adapter_id,rank,rate_rps\na,8,-1\n", ":2: column 'rate_rps': '-1' is not a number in plain notation"),
    ("adapter_id,rank,rate_rps\na,8,nan\n", ":2: column 'rate_rps': 'nan' is not a number"),
    ("adapter_id,rank,rate_rps\na,8,inf\n", ":2: column 'rate_rps': 'inf' is not a number"),
    ("adapter_id,rank,rate_rps\na,8,fast\n", "'fast' is not a number"),
    ("adapter_id,rank,rate_rps\na,64,1\n", ":2: column 'rank': 64 cannot be served by profile"),
    ("adapter_id,rank,rate_rps\na,eight,1\n", "'eight' is not an integer in plain notation (a LoRA rank"),
    ("", "is empty"),
    ("adapter_id,rank,rate_rps\n", "has a header but no adapters"),
    ("adapter_id;rank;rate_rps\na;8;1\n", "uses another delimiter"),
    ("adapter_id,rank,rate_rps\na,8\n", ":2: has 2 fields but the header has 3"),
    ("adapter_id,rank,rate_rps,input_tokens\na,8,1,\nb,8,1,200000\n",
     ":3: column 'input_tokens': a request of 200000 prompt tokens does not fit max_model_len"),
])
def test_bad_workloads_name_line_column_and_fix(tmp_path, text, expect):
    with pytest.raises(WorkloadError, match=None) as exc:
        read_workload(write(tmp_path, text), load_profile("h100-64gb-qwen2.5-7b"))
    assert expect in str(exc.value)
    assert "\n" not in str(exc.value)


def test_non_utf8_is_reported_with_its_line(tmp_path):
    p = write(tmp_path, "", raw=b"adapter_id,rank,rate_rps\n\xff\xfe,8,1\n")
    with pytest.raises(WorkloadError, match=r":2: is not UTF-8"):
        read_workload(p)


def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path):
    p = write(tmp_path, "adapter_id,rank,rate_rps\na,8,-3\n")
    res = CliRunner().invoke(main, ["simulate", str(p), "--a-max", "4", "--duration", "10"])
    assert res.exit_code == 2
    assert res.output.strip().startswith("error: ") and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == [p]
