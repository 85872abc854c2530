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


def test_causal_work_is_the_blocks_on_and_below_the_diagonal():
    assert profile.work_blocks(2, 16, 8192, causal=False) == 2 * 16 * 64 * 64
    assert profile.work_blocks(2, 16, 8192, causal=True) == 2 * 16 * (64 * 65 // 2)
    assert profile.work_blocks(1, 1, 128, causal=True) == 1  # one block, which the diagonal crosses


def test_the_profiled_call_gets_the_mask_and_the_heads(monkeypatch, tmp_path):
    seen = []

    class Done:
        returncode, stdout, stderr = 1, "", "ncu: no kernel"
    monkeypatch.setattr(profile.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    got = profile.profile("ncu", "step15", (2, 32, 8192), ["sm__cycles_elapsed.max"], tmp_path / "raw.csv", 8, "top_left")
    assert "error" in got
    cmd = " ".join(seen[0])
    assert "--one step15 --shape 2,32,8192 --heads-k 8 --causal top_left" in cmd
    profile.profile("ncu", "step14", (2, 16, 8192), ["sm__cycles_elapsed.max"], tmp_path / "raw.csv")
    assert "--heads-k" not in seen[1] and "--causal" not in seen[1]


@pytest.mark.parametrize("argv", [["--shape", "2,16,64", "--heads-k", "3"], ["--shape", "2,16,64", "--heads-k", "0"],
                                  ["--shape", "2,16"], ["--shape", "2,x,64"],
                                  ["--causal", "diagonal"]])
def test_a_bad_request_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        profile.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


CAUSAL_RUN = RUN.parent / "2026-12-01-fa3-recipe" / "ncu-causal-8k"


@pytest.mark.parametrize("impl", ["step15", "s15dyn", "fa3"])
def test_reads_how_evenly_the_sms_work(impl):
    """A causal profile: the SMs' least, mean and most active cycles are read, ordered, and are what the log printed."""
    metrics = [m for _, m in profile.METRICS]
    got = profile.parse_ncu_csv((CAUSAL_RUN / f"ncu-{impl}.csv").read_text(), metrics)
    least, mean, most = (got[f"sm__cycles_active.{x}"] for x in ("min", "avg", "max"))
    assert 0 < least <= mean <= most <= got["sm__cycles_elapsed.max"]
    log = (CAUSAL_RUN / "c8k.log").read_text()
    assert "causal from the top left" in log and all(f"{v:.4g}" in log for v in (least, mean, most))
