"""CPU: the benchmark's timer (verify/bench.py) on a simulated GPU and clock; GPU: the same on the card.

The simulated GPU runs each call in a fixed number of SM cycles at the clock of the moment, after a
fixed-time L2 flush, back to back unless the CPU (launch_s per call) falls behind; the clock readings are
taken every READ_S from a function of time. Every clock, duration and power figure below is synthetic.
"""
import argparse
import math
import statistics
import time

import pytest

from verify import bench
from verify.bench import SteadyState, Timing
from verify.tests.conftest import needs_gpu

T = Timing()
BOOST_MHZ, HELD_MHZ = 1980.0, 1755.0  # synthetic: a card that boosts high when rested, lower under load
FALL_S = 2.0                          # synthetic: how long the clock falls before it holds
POWER_W = 600.0                       # synthetic
READ_S = 0.02                         # the clock is read this often
FAST_S = 0.5e-3                       # a call of a fast kernel at boost clock
FLUSH_S = 0.07e-3                     # the L2 flush
LIMIT_S = 10 * (T.warmup_s + T.settle_max_s + T.window_s)  # a timer still running then is stuck


def steady(t):
    return BOOST_MHZ


def falls_then_holds(t):
    return BOOST_MHZ - (BOOST_MHZ - HELD_MHZ) * min(t, FALL_S) / FALL_S


def never_settles(t):  # keeps falling by twice the settle threshold per settle span
    return BOOST_MHZ - 2 * T.settle_mhz / T.settle_s * t


class FakeGPU:
    def __init__(self, mhz_at, call_s=FAST_S, launch_s=FAST_S / 20):
        self.mhz_at, self.launch_s = mhz_at, launch_s
        self.cycles = call_s * BOOST_MHZ * 1e6
        self.host = 0.0      # the CPU's time
        self.free_at = 0.0   # when the GPU has finished everything queued
        self.ms: list[float] = []  # every launched call's duration

    def launch(self):
        self.host += self.launch_s
        assert self.host < LIMIT_S, "the timer never stopped"
        flush_start = max(self.free_at, self.host)  # the GPU waits when the CPU is late
        start = flush_start + FLUSH_S
        end = start + self.cycles / (self.mhz_at(start) * 1e6)
        self.free_at = end
        self.ms.append((end - start) * 1e3)
        return flush_start, start, end

    def wait(self, call):
        self.host = max(self.host, call[2])
        return call

    def drain(self):
        self.host = max(self.host, self.free_at)


def readings_of(mhz_at, read_s=READ_S):
    def readings(a, b):
        return [(mhz_at(k * read_s), POWER_W) for k in range(math.ceil(a / read_s), math.floor(b / read_s) + 1)]
    return readings


def timed(mhz_at, timing=T, clock=True, read_s=READ_S, **gpu_args):
    gpu = FakeGPU(mhz_at, **gpu_args)
    state = bench.drive(gpu, SteadyState(timing, readings_of(mhz_at, read_s) if clock else None), timing.ahead_s)
    return gpu, state, state.summary()


def warmup_end(state):
    return state.calls[state.first_window - 1][2] - state.calls[0][0]


def test_warmup_waits_while_the_clock_falls():
    _, state, s = timed(falls_then_holds)
    assert s["warmup_ended_by"] == "clock"
    assert FALL_S <= warmup_end(state) <= FALL_S + 2 * T.settle_s, warmup_end(state)
    assert s["sm_mhz_min"] == s["sm_mhz_max"] == HELD_MHZ, "the window must lie after the fall"
    assert s["power_w_median"] == POWER_W and s["clock_readings"] >= T.window_s / READ_S


def test_warmup_of_a_steady_clock_lasts_warmup_s():
    _, state, s = timed(steady)
    assert s["warmup_ended_by"] == "clock"
    assert warmup_end(state) >= T.warmup_s > state.calls[state.first_window - 2][2] - state.calls[0][0]


def test_a_clock_that_never_settles_hits_the_cap():
    _, state, s = timed(never_settles)
    assert s["warmup_ended_by"] == "cap"
    cap = T.warmup_s + T.settle_max_s
    assert warmup_end(state) >= cap > state.calls[state.first_window - 2][2] - state.calls[0][0]


def test_without_a_clock_source_warmup_lasts_warmup_s():
    _, state, s = timed(falls_then_holds, clock=False)
    assert s["warmup_ended_by"] == "no clock"
    assert warmup_end(state) >= T.warmup_s > state.calls[state.first_window - 2][2] - state.calls[0][0]
    assert s["sm_mhz_median"] is None and s["clock_readings"] == 0


def test_a_slowly_read_clock_gets_longer_settle_spans():
    read_s = T.settle_s  # one reading per span: too few to tell a trend
    _, _, s = timed(steady, read_s=read_s)
    assert s["warmup_ended_by"] == "cap"
    fitted = bench.fit_to_clock(T, read_s)
    _, _, s = timed(steady, timing=fitted, read_s=read_s)
    assert s["warmup_ended_by"] == "clock"
    assert bench.fit_to_clock(T, READ_S) == T, "NVML's readings are frequent enough for the default spans"


def test_a_slow_implementation_gets_the_minimum_calls_and_no_more():
    gpu, _, s = timed(steady, call_s=1.5 * max(T.warmup_s, T.window_s), launch_s=1e-4)
    assert (s["warmup_calls"], s["window_calls"]) == (T.min_warmup_calls, T.min_window_calls)
    assert len(gpu.ms) == T.min_warmup_calls + T.min_window_calls, "calls were queued that the window did not need"


def test_the_window_covers_window_s_and_its_median_is_the_figure():
    gpu, state, s = timed(falls_then_holds)
    assert T.window_s <= s["window_s"] < T.window_s + 2 * state.per_call_s()
    assert s["warmup_calls"] + s["window_calls"] == len(state.calls)
    window_ms = gpu.ms[s["warmup_calls"]:len(state.calls)]
    assert s["median_ms"] == statistics.median(window_ms)


def test_burst_is_the_first_calls_after_the_pause():
    gpu, _, s = timed(falls_then_holds)  # calls get slower while the clock falls: each prefix has its own median
    assert s["burst_calls"] == min(T.burst_calls, s["warmup_calls"])
    assert s["burst_median_ms"] == statistics.median(gpu.ms[:T.burst_calls])
    assert s["burst_median_ms"] < s["median_ms"]


def test_the_gpu_never_waits_for_the_cpu():
    _, _, s = timed(falls_then_holds)
    assert s["idle_pct"] == 0


def test_idle_shows_a_cpu_that_falls_behind():
    _, _, s = timed(steady, launch_s=2 * FAST_S)
    assert s["idle_pct"] > 0


def test_log_line_shows_the_clock_and_the_cap():
    _, _, s = timed(never_settles)
    line = bench.log_line("N=4096 batch=4 fake", bench.with_tflops(s, bench.flops(4, bench.HEADS, 4096)))
    assert f"SM {s['sm_mhz_min']:.0f}-{s['sm_mhz_max']:.0f} MHz" in line and f"{s['power_w_median']:.0f} W" in line
    assert "CAP" in line and f"{s['tflops']:.1f} TFLOP/s" in line and f"burst {s['burst_tflops']:.1f}" in line
    _, _, s = timed(steady, clock=False)
    assert "SM clock not read" in bench.log_line("fake", bench.with_tflops(s, 1))


@pytest.mark.parametrize("field", [f.name for f in bench.dataclasses.fields(Timing)])
@pytest.mark.parametrize("bad", [-1, math.nan])
def test_timing_rejects_bad_values(field, bad):
    with pytest.raises(ValueError, match=f"Timing.{field} must be"):
        Timing(**{field: bad})


def test_timing_flags():
    ap = argparse.ArgumentParser()
    bench.add_timing_args(ap)
    assert bench.timing_from_args(ap.parse_args([])) == Timing()
    window = 2 * T.window_s
    assert bench.timing_from_args(ap.parse_args(["--window", str(window)])).window_s == window
    for flag in bench.TIMING_FLAGS:
        with pytest.raises(SystemExit):
            ap.parse_args([flag, "-1"])


def test_parse_smi():
    mhz, watts = HELD_MHZ, POWER_W
    assert bench.parse_smi(f"{mhz:.0f}, {watts:.2f}") == (mhz, watts)
    assert bench.parse_smi(f"{mhz:.0f}, [N/A]") == (mhz, None)


def test_clock_sampler_keeps_timed_readings():
    count = iter(range(10**9))
    def read():
        time.sleep(READ_S / 4)
        return float(next(count)), None
    with bench.ClockSampler(period_s=1e-3, read=read, source="fake") as sampler:
        time.sleep(0.05)
    assert sampler.interval_s >= 1e-3 + READ_S / 4
    everything = sampler.between(-math.inf, math.inf)
    assert len(everything) >= 2
    times = sampler._times
    middle = times[len(times) // 2]
    assert sampler.between(middle, math.inf) == everything[len(times) // 2:]
    assert sampler.between(-math.inf, middle) == everything[:len(times) // 2 + 1]


# ---- on the GPU (skipped without one) ----

SHORT = Timing(warmup_s=0.2, settle_max_s=0.2, window_s=0.1)


@needs_gpu
def test_measure_on_the_gpu():
    import torch
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with bench.ClockSampler() as sampler:
        s = bench.measure(lambda: a @ a, bench.L2Flush(), sampler, SHORT)
    assert s["window_s"] >= SHORT.window_s and s["window_calls"] >= SHORT.min_window_calls
    assert s["min_ms"] <= s["median_ms"] <= s["max_ms"] and s["burst_calls"] <= SHORT.burst_calls
    assert s["idle_pct"] < 5, f"the GPU waited for the CPU {s['idle_pct']:.1f}% of the window"
    if sampler.source is not None:
        assert s["clock_readings"] > 0 and 0 < s["sm_mhz_min"] <= s["sm_mhz_median"] <= s["sm_mhz_max"]


@needs_gpu
def test_run_on_the_gpu():
    lines = []
    out = bench.run({}, [1024], log=lines.append, timing=SHORT)
    peers = {"fa3"} if bench.fa3_attention()[0] is not None else set()  # timed where installed
    assert set(out["timings"]) == {*bench.SDPA_BACKENDS, "cublas_gemm", *peers}
    for name in bench.SDPA_BACKENDS:
        assert out["timings"][name].get(1024) or name in out["unavailable"], name
    gemm = out["timings"]["cublas_gemm"][str(bench.GEMM_N)]
    assert gemm["tflops"] > 0 and gemm["window_calls"] >= SHORT.min_window_calls
    assert out["method"]["window_s"] == SHORT.window_s and "clock_source" in out["method"]
    assert any("SM " in line for line in lines), lines


def test_nvml_without_board_power_still_reads_the_clock(monkeypatch):
    """Some boards (GeForce cards among them) report no power to NVML: the clock is read through NVML alone,
    rather than the whole source given up for nvidia-smi's slower readings."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 2520)

    def no_power(device=None):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
    monkeypatch.setattr(torch.cuda, "power_draw", no_power)
    source, read = bench.ClockSampler._find_source()
    assert source == "nvml" and read() == (2520.0, None)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 350_000)  # mW
    source, read = bench.ClockSampler._find_source()
    assert source == "nvml" and read() == (2520.0, 350.0)


# ---- the causal table's pieces (CPU) ----

@pytest.mark.parametrize("table", bench.CAUSAL_TABLES)
@pytest.mark.parametrize("n", bench.CAUSAL_SEQLENS)
def test_the_causal_shapes_hold_16k_tokens_with_their_heads(table, n):
    batch, heads, heads_kv, seqlen = bench.causal_shape_of(table, n)
    assert batch * seqlen == bench.TOTAL_TOKENS and seqlen == n
    assert (heads, heads_kv) == {"causal": (bench.HEADS, bench.HEADS), "gqa": (32, 8)}[table]  # gqa: Llama-3-8B's


def test_causal_flops_are_half_the_dense_ones():
    assert bench.causal_flops(4, 16, 4096) == 2 * 4 * 16 * 4096**2 * 128 == bench.flops(4, 16, 4096) // 2
    for table in bench.CAUSAL_TABLES:  # grouped heads compute as many FLOPs: the query heads count
        batch, heads, _, n = bench.causal_shape_of(table, 8192)
        assert bench.causal_flops(batch, heads, n) == 2 * batch * heads * n * n * bench.HEAD_DIM


def test_the_causal_rows_and_their_seqlens():
    assert bench.causal_names("step15") == {"causal": ["step15_causal", "sdpa_cudnn_causal", "fa3_causal"],
                                            "gqa": ["step15_gqa", "sdpa_cudnn_gqa", "fa3_gqa"]}
    assert all(name in bench.LABELS for names in bench.causal_names("x").values() for name in names[1:])
    assert bench.causal_seqlens(bench.SEQLENS_OF_RECORD) == bench.CAUSAL_SEQLENS == [4096, 8192, 16384]
    assert bench.causal_seqlens([16384, 1024]) == [16384] and bench.causal_seqlens([1024, 2048]) == []
    method = bench.causal_method("step15", [4096])
    assert method["step"] == "step15" and method["seqlens"] == [4096] and method["rows"] == bench.causal_names("step15")
    assert method["tables"] == {"causal": {"heads": 16, "heads_kv": 16}, "gqa": {"heads": 32, "heads_kv": 8}}


def test_fa3_takes_the_causal_masks_it_computes():
    for causal, nq, nk in ((False, 64, 128), ("top_left", 128, 128), ("bottom_right", 64, 128)):
        bench.fa3_causal(causal, nq, nk)
    with pytest.raises(ValueError, match="aligned to the bottom right"):
        bench.fa3_causal("top_left", 64, 128)
    with pytest.raises(ValueError, match="give False"):
        bench.fa3_causal(True, 128, 128)


def test_a_refused_sdpa_call_is_said_with_torch_s_reasons():
    import warnings

    def refused():  # what torch says when no backend allowed takes a call (sdp_utils.cpp's TORCH_WARNs, then the error)
        warnings.warn("Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:1)")
        warnings.warn("Flash attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:2)")
        warnings.warn("CuDNN attention kernel not used because: (Triggered internally at sdp_utils.cpp:3)")
        warnings.warn("cuDNN does not support grouped-query attention (Triggered internally at sdp_utils.cpp:4)")
        raise RuntimeError("No available kernel. Aborting execution.")
    assert bench.refusal(refused) == "cuDNN does not support grouped-query attention; No available kernel. Aborting execution."
    assert bench.refusal(lambda: None) is None
    with pytest.raises(ValueError):
        bench.refusal(lambda: bench.fa3_causal(True, 1, 1))


def test_the_causal_rows_call_what_the_table_says():
    torch = pytest.importorskip("torch")
    got = []
    step = bench.CausalStep("step15", lambda q, k, v, causal=False: got.append(("step", k.shape[1], causal)), True)

    def fa3(q, k, v, scale=None, causal=False):
        got.append(("fa3", k.shape[1], causal, q.transpose(1, 2).is_contiguous()))
    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    fns, why = bench.causal_fns("gqa", q, k, v, step, fa3)
    assert list(fns) == bench.causal_names("step15")["gqa"] and not why
    fns["step15_gqa"]()
    fns["fa3_gqa"]()
    assert got == [("step", 2, "top_left"), ("fa3", 2, "top_left", True)]  # FA3 on [B, N, H, D] copies
    # SDPA forced to cuDNN: on a CPU tensor torch refuses, and the cell would say why, never run another backend
    assert "No viable backend" in bench.refusal(fns["sdpa_cudnn_gqa"])
    no_gqa = step._replace(gqa=False)
    fns, why = bench.causal_fns("gqa", q, k, v, no_gqa, None)
    assert list(fns) == ["sdpa_cudnn_gqa"] and why == {"step15_gqa": "step15 takes no grouped key/value heads (info['gqa'] is False)"}
    fns, why = bench.causal_fns("causal", q, q, q, no_gqa, None)  # equal heads: a step without GQA takes it
    assert list(fns) == ["step15_causal", "sdpa_cudnn_causal"] and not why


def test_the_causal_table_s_step_is_the_last_that_takes_causal_masks():
    import types

    from verify import __main__ as verify_main
    mod = lambda causal, gqa=False: types.SimpleNamespace(info={"causal": causal, "gqa": gqa}, attention=object())
    modules = {"step13": mod(False), "step14": mod(True, False), "step15": mod(True, True), "step16": mod(False)}
    chosen = verify_main.causal_step(modules)
    assert chosen == bench.CausalStep("step15", modules["step15"].attention, True)
    assert verify_main.causal_step({"step14": mod(True)}).gqa is False
    assert verify_main.causal_step({"step01": mod(False)}) is None and verify_main.causal_step({}) is None


def test_the_causal_table_can_be_skipped_on_the_command_line():
    import subprocess
    import sys

    from verify.steps import ROOT
    out = subprocess.run([sys.executable, "-m", "verify", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--no-causal" in out.stdout, out.stderr


@needs_gpu
def test_run_times_the_causal_table_on_the_gpu():
    """A stand-in causal step (SDPA FLASH): the table's rows at one N, each refused cell said, never another backend."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q, k, v, scale=None, causal=False):
        assert causal == "top_left"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), None
    out = bench.run({}, [1024, 4096], timing=SHORT, log=lambda *_: None, causal=bench.CausalStep("fake", attention, True))
    assert out["causal"]["seqlens"] == [4096] and out["causal"]["step"] == "fake"
    for table, names in bench.causal_names("fake").items():
        batch, heads, heads_kv, n = bench.causal_shape_of(table, 4096)
        cell = out["timings"][names[0]][4096]
        assert (cell["batch"], cell["heads"], cell["heads_kv"]) == (batch, heads, heads_kv)
        assert cell["tflops"] == pytest.approx(bench.causal_flops(batch, heads, n) / (cell["median_ms"] * 1e-3) / 1e12)
        for name in names[1:]:
            assert out["timings"][name].get(4096) or 4096 in out["not_timed"].get(name, {}) or name in out["unavailable"], name


# ---- the breadth tables (step40 on: fp16; step41 on: head dim 64) ----

def test_the_breadth_rows_and_their_method():
    assert bench.breadth_names("step40", ["fp16"]) == {
        "fp16": ["step40_fp16", "sdpa_cudnn_fp16", "fa3_fp16"],
        "fp16_causal": ["step40_fp16_causal", "sdpa_cudnn_fp16_causal", "fa3_fp16_causal"]}
    step = bench.BreadthStep("step40", object(), ("fp16",))
    method = bench.breadth_method(step, [4096, 8192])
    assert method["step"] == "step40" and method["seqlens"] == [4096, 8192]
    assert method["rows"] == bench.breadth_names("step40", ["fp16"])
    assert method["tables"] == {"fp16": {"dtype": "float16", "head_dim": 128, "heads": 16}}
    both = bench.breadth_method(bench.BreadthStep("step41", object(), ("fp16", "hdim64")), [4096])
    assert both["tables"]["hdim64"] == {"dtype": "bfloat16", "head_dim": 64, "heads": 16}
    assert list(both["rows"]) == ["fp16", "fp16_causal", "hdim64", "hdim64_causal"]
    assert both["rows"]["hdim64"] == ["step41_hdim64", "sdpa_cudnn_hdim64", "fa3_hdim64"]
    torch = pytest.importorskip("torch")
    assert all(isinstance(getattr(torch, t["dtype"]), torch.dtype) and t["head_dim"] in (64, 128)
               for t in bench.BREADTH_TABLES.values())


def test_the_breadth_rows_call_what_the_table_says():
    torch = pytest.importorskip("torch")
    got = []
    step = bench.BreadthStep("step40", lambda q, k, v, causal=False: got.append(("step", q.dtype, causal)), ("fp16",))

    def fa3(q, k, v, scale=None, causal=False):
        got.append(("fa3", q.dtype, causal, q.transpose(1, 2).is_contiguous()))
    q = torch.zeros(1, 2, 8, 128, dtype=torch.float16)
    for table, mask in (("fp16", False), ("fp16_causal", "top_left")):
        fns = bench.breadth_fns(table, q, q, q, step, fa3)
        assert list(fns) == bench.breadth_names("step40", ["fp16"])[table]
        fns[f"step40_{table}"]()
        fns[f"fa3_{table}"]()
        assert got[-2:] == [("step", torch.float16, mask), ("fa3", torch.float16, mask, True)]
        assert "No viable backend" in bench.refusal(fns[f"sdpa_cudnn_{table}"])  # CPU tensors: said, never rerouted
    assert list(bench.breadth_fns("fp16", q, q, q, step, None)) == ["step40_fp16", "sdpa_cudnn_fp16"]


def test_the_breadth_tables_step_is_the_last_that_takes_fp16_or_head_dim_64():
    import types

    from verify import __main__ as verify_main
    mod = lambda dtypes, dims=(128,): types.SimpleNamespace(info={"dtypes": dtypes, "head_dims": list(dims)},  # noqa: E731
                                                            attention=object())
    modules = {"step39": mod(["bfloat16"]), "step40": mod(["bfloat16", "float16"]), "step41": mod(["bfloat16"])}
    assert verify_main.breadth_step(modules) == bench.BreadthStep("step40", modules["step40"].attention, ("fp16",))
    assert verify_main.breadth_step({"step39": mod(["bfloat16"])}) is None and verify_main.breadth_step({}) is None
    modules["step41"] = mod(["bfloat16", "float16"], (64, 128))
    assert verify_main.breadth_step(modules) == bench.BreadthStep("step41", modules["step41"].attention, ("fp16", "hdim64"))
    assert verify_main.breadth_step({"s": mod(["bfloat16"], (64, 128))}).tables == ("hdim64",)
