"""CPU: verify.profile reads ncu's raw CSV as a GPU run wrote it (the files of results/h200/2026-12-01-fa3-side-by-side)."""
from pathlib import Path

import pytest

from verify import profile

RUN = Path(__file__).resolve().parents[2] / "results" / "h200" / "2026-12-01-fa3-side-by-side"


@pytest.mark.parametrize("impl", ["step14", "fa3"])
def test_reads_the_kernel_and_its_counters(impl):
    metrics = [m for _, m in profile.METRICS] + [profile.STALL_METRIC.format(s) for s in profile.STALLS]
    got = profile.parse_ncu_csv((RUN / f"ncu-{impl}.csv").read_text(), metrics)
    assert got is not None and got["kernels_in_call"] >= 1
    assert ("attention_fwd_kernel" if impl == "step14" else "FlashAttnFwdSm90") in got["kernel"]
    # the table's numbers are the CSV's: the log written in the same run shows them
    log = (RUN / "profile.log").read_text()
    assert f"{got['sm__cycles_elapsed.max']:.4g}" in log and f"{got['smsp__inst_executed.sum']:.4g}" in log
    assert 0 < got["smsp__inst_executed_pipe_uniform.sum"] < got["smsp__inst_executed.sum"]


def test_no_kernel_is_none():
    assert profile.parse_ncu_csv("==PROF== Disconnected\n", ["sm__cycles_elapsed.max"]) is None
