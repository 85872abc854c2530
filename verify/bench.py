"""Timing: every step, torch SDPA's cuDNN / FLASH / EFFICIENT backends and, where it is installed,
FlashAttention-3 (the `fa3-fwd` package), in one run, on the same inputs.

What a user running a model for minutes gets is the steady state, not a boost-clock burst: the H200
boosts to 1980 MHz when rested and settles lower under load (700 W power limit), and the kernels that
draw the most power lose the most. So each (implementation, N) is timed in three phases:

1. one call, synchronized (lazy set-up such as cuDNN's plan stays out of the timing), a short pause;
2. warm-up: back-to-back calls for at least `warmup_s` and until the SM clock has stopped falling,
   or for at most `settle_max_s` more (the cell records which ended it);
3. the window: back-to-back calls for at least `window_s`; their median is the figure of record.

Every call is timed with CUDA events, after an L2 flush (a 256 MB memset, 4x the H200's 60 MB L2).
The CPU keeps about `ahead_s` of calls queued and waits only for the oldest, so the GPU does not wait
for Python between calls; each cell records the GPU's idle share of its window. A slow implementation
(step01: ~1 s a call at N = 16K) gets `min_warmup_calls` / `min_window_calls` where the time spans
would hold fewer calls. The old benchmark's burst figure is kept beside it: the median of the first
<= `burst_calls` warm-up calls, i.e. right after the pause. A thread reads the SM clock and the board
power all along (NVML through torch.cuda, else nvidia-smi; read only: no setting of the card is
changed; a board that reports no power gets the clock alone) and each cell records the clock range of its window.

The causal table (the last step that takes causal masks, info["causal"]: step15 on) times causal attention
(SDPA's is_causal=True: row i sees keys 0..i) the same way, at N = 4K, 8K, 16K (those of the run's seqlens): 16 heads
(batch = 16K/N), and Llama-3-8B's grouped heads, 32 query heads over 8 key/value heads; beside SDPA forced to cuDNN
(is_causal=True; enable_gqa=True for the grouped heads) and FlashAttention-3 (flash_attn_func(causal=True)). Its
TFLOP/s count half the dense FLOPs (causal_flops): the diagonal's half of the score matrix is all there is to compute.

The breadth tables (the last step that takes fp16 or another head dim, info["dtypes"], info["head_dims"]: step40 on)
time what else a model passes, at the same N, 16 heads (batch = 16K/N), dense and causal, beside SDPA cuDNN and FA3
given the same: fp16 inputs ("fp16", rows stepNN_fp16, sdpa_cudnn_fp16, fa3_fp16, and stepNN_fp16_causal, ...), bf16
at head dim 64 ("hdim64", rows stepNN_hdim64, sdpa_cudnn_hdim64, fa3_hdim64, ...). The step's bf16 rows at head dim
128 in the same shapes are the dense and causal tables' own, so each breadth row is read against them in one run.

`SteadyState` makes the warm-up / window decisions and `drive` does the queueing; neither touches
the GPU, so tests/test_bench.py runs both on a simulated GPU and clock.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import math
import statistics
import subprocess
import sys
import threading
import time
import warnings
from typing import Callable, NamedTuple

HEADS = 16
HEAD_DIM = 128
TOTAL_TOKENS = 16384
# A video diffusion transformer's self-attention: Wan 2.1 at 480 x 832, 81 frames (a 21 x 60 x 104 latent), batch 1,
# its 12 heads. Not a multiple of 128: the steps that need one (01-07) are not timed there.
VIDEO_SEQLEN, VIDEO_HEADS = 32760, 12
SEQLENS_OF_RECORD = [1024, 2048, 4096, 8192, 16384, VIDEO_SEQLEN]  # batch = 16384 / N (docs/ladder.md), and the video shape
GEMM_N = 8192
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
PEERS = ["fa3"]  # kernels from elsewhere, timed where installed (never a dependency of a step)
LABELS = {"sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA FLASH (FA2)", "sdpa_efficient": "SDPA EFFICIENT",
          "fa3": "FlashAttention-3", "cublas_gemm": f"cuBLAS GEMM {GEMM_N}^3"}
# The causal table: causal attention at the headline N, with as many key/value heads as query heads ("causal") and
# with Llama-3-8B's grouped ones ("gqa": 32 query heads over 8 key/value heads); batch = 16K/N in both.
CAUSAL_SEQLENS = [4096, 8192, 16384]
CAUSAL_TABLES = {"causal": (HEADS, HEADS), "gqa": (32, 8)}  # table: (query heads, key/value heads)
CAUSAL_PEERS = ["sdpa_cudnn", "fa3"]  # timed beside the step in each table: f"{peer}_{table}"
LABELS |= {"sdpa_cudnn_causal": "SDPA cuDNN causal", "fa3_causal": "FA3 causal",
           "sdpa_cudnn_gqa": "SDPA cuDNN GQA", "fa3_gqa": "FA3 GQA"}
# The breadth tables: {table: the inputs' dtype (a torch attribute) and head dim}, each timed dense and causal
# (table + "_causal").
BREADTH_TABLES = {"fp16": {"dtype": "float16", "head_dim": HEAD_DIM}, "hdim64": {"dtype": "bfloat16", "head_dim": 64}}
BREADTH_PEERS = ["sdpa_cudnn", "fa3"]  # timed beside the step: f"{peer}_{table}"


def shape_of(seqlen: int) -> tuple[int, int, int]:
    """(batch, heads, N) of a benchmark column: the video shape at VIDEO_SEQLEN, else 16384 tokens in batch = 16K/N."""
    if seqlen == VIDEO_SEQLEN:
        return 1, VIDEO_HEADS, seqlen
    return max(1, TOTAL_TOKENS // seqlen), HEADS, seqlen


def fa3_attention():
    """FlashAttention-3's forward, as (attention(q, k, v, scale=None) -> (o, lse) on SDPA's [B, H, N, D] layout, None),
    or (None, why) where the fa3-fwd package is not installed or does not load.

    fa3-fwd is FA3's forward built on torch's stable ABI. Its interface module imports FA3's configuration under the
    name `flash_attn_config`, which this wheel ships as `fa3_fwd_config`: the one-line alias below stands in for it."""
    try:
        import fa3_fwd_config
        sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
        import fa3_fwd_interface
    except ImportError as e:  # not installed, or its library does not load under this torch
        return None, f"not installed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def attention(q, k, v, scale=None, causal=False):
        """causal as the steps take it: False, "top_left" or "bottom_right"; k/v may have fewer heads (a divisor)."""
        fa3_causal(causal, q.shape[2], k.shape[2])
        # FA3 takes [B, N, H, D] with a contiguous last dim: SDPA's [B, H, N, D] transposed, a view (no copy)
        o, lse = fa3_fwd_interface.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   softmax_scale=scale, causal=bool(causal), return_attn_probs=True)
        return o.transpose(1, 2), lse
    return attention, None


def fa3_causal(causal, seqlen_q: int, seqlen_k: int) -> None:
    """Raises ValueError for a `causal` that FA3's flash_attn_func(causal=True) does not compute. Its diagonal starts
    from the bottom right (row i sees keys 0..i + seqlen_k - seqlen_q): SDPA's top-left one only where the lengths agree."""
    if causal not in (False, None, "top_left", "bottom_right"):
        raise ValueError(f"FA3: causal={causal!r}: give False, 'top_left' or 'bottom_right'")
    if causal == "top_left" and seqlen_q != seqlen_k:
        raise ValueError(f"FA3: a top-left causal mask with seqlen_q {seqlen_q} != seqlen_k {seqlen_k}: FA3's causal "
                         "mask is aligned to the bottom right")


def flops(batch: int, heads: int, seqlen: int, head_dim: int = HEAD_DIM) -> int:
    """Two matmuls of 2*N*N*d FLOPs each, per (batch, head)."""
    return 4 * batch * heads * seqlen * seqlen * head_dim


def causal_flops(batch: int, heads: int, seqlen: int, head_dim: int = HEAD_DIM) -> int:
    """Causal attention's work, counted as FlashAttention counts it: half the dense FLOPs (the diagonal's half of the
    score matrix; heads are the query heads, grouped key/value heads compute as many)."""
    return flops(batch, heads, seqlen, head_dim) // 2


def causal_shape_of(table: str, seqlen: int) -> tuple[int, int, int, int]:
    """(batch, query heads, key/value heads, N) of a causal table's column: batch = 16K/N, as the dense table's."""
    heads, heads_kv = CAUSAL_TABLES[table]
    return max(1, TOTAL_TOKENS // seqlen), heads, heads_kv, seqlen


def causal_seqlens(seqlens: list[int]) -> list[int]:
    """The causal table's N in a run of `seqlens`: those of CAUSAL_SEQLENS it has."""
    return [n for n in CAUSAL_SEQLENS if n in seqlens]


def causal_names(step: str) -> dict[str, list[str]]:
    """{table: its rows}: the step's, then SDPA cuDNN's and FA3's, e.g. step15_causal, sdpa_cudnn_causal, fa3_causal."""
    return {table: [f"{impl}_{table}" for impl in (step, *CAUSAL_PEERS)] for table in CAUSAL_TABLES}


def breadth_names(step: str, tables) -> dict[str, list[str]]:
    """{table: its rows} of the breadth tables `tables` (of BREADTH_TABLES), dense then causal: the step's, then SDPA
    cuDNN's and FA3's, e.g. {"fp16": [step40_fp16, sdpa_cudnn_fp16, fa3_fp16], "fp16_causal": [step40_fp16_causal, ...]}."""
    return {f"{t}{c}": [f"{impl}_{t}{c}" for impl in (step, *BREADTH_PEERS)] for t in tables for c in ("", "_causal")}


class BreadthStep(NamedTuple):
    """The step of the breadth tables: its name, attention(q, k, v, scale=None, causal=...) and the tables (of
    BREADTH_TABLES) it takes: "fp16" where info["dtypes"] has float16, "hdim64" where info["head_dims"] has 64."""
    name: str
    attention: Callable
    tables: tuple


def breadth_fns(table: str, q, k, v, step: BreadthStep, fa3) -> dict:
    """A breadth table's rows at these inputs (already in the table's dtype): {name: fn}; `table` ends in "_causal" for
    causal calls (SDPA's is_causal=True, the steps' and FA3's top-left corner: the lengths agree)."""
    names, mask = breadth_names(step.name, [table.removesuffix("_causal")])[table], table.endswith("_causal")
    fns = {names[0]: lambda: step.attention(q, k, v, causal="top_left" if mask else False),
           names[1]: sdpa_fn(SDPA_BACKENDS["sdpa_cudnn"], q, k, v, is_causal=mask)}
    if fa3:  # on [B, N, H, D] copies, FA3's own layout, made once outside the timing
        qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        fns[names[2]] = lambda: fa3(qt, kt, vt, causal="top_left" if mask else False)
    return fns


def breadth_method(step: BreadthStep, seqlens: list[int]) -> dict:
    """What the results file says of the breadth tables: the step, the N, the rows, each table's dtype and shapes."""
    return {"step": step.name, "seqlens": list(seqlens), "rows": breadth_names(step.name, step.tables),
            "tables": {t: {**BREADTH_TABLES[t], "heads": HEADS} for t in step.tables},
            "mask": "dense, and top_left (is_causal=True) in the _causal tables, whose FLOPs are half the dense ones"}


class CausalStep(NamedTuple):
    """The step of the causal table: its name, attention(q, k, v, scale=None, causal=...) and whether it takes
    fewer key/value heads (info["gqa"])."""
    name: str
    attention: Callable
    gqa: bool


@dataclasses.dataclass(frozen=True)
class Timing:
    """How each (implementation, N) is timed; spans are seconds of GPU time."""
    warmup_s: float = 1.0       # warm-up: at least this long, and until the SM clock stops falling ...
    settle_max_s: float = 2.0   # ... but no more than this much longer (the cell records which ended it)
    window_s: float = 0.5       # the timed window: at least this long
    min_warmup_calls: int = 2   # a slow implementation gets these counts where the spans hold fewer calls
    min_window_calls: int = 5
    burst_calls: int = 100      # the burst figure: the first <= this many warm-up calls (the old benchmark's 100)
    settle_s: float = 0.25      # stopped falling: the mean clock over the last settle_s is no more than
    settle_mhz: float = 15.0    # settle_mhz (one H200 clock step) below its mean over the settle_s before
    pause_s: float = 0.1        # between implementations: the burst starts after this pause
    ahead_s: float = 0.05       # GPU work kept queued ahead of the CPU

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), 1 if f.type == "int" else 0
            if not value >= least:  # NaN fails too
                raise ValueError(f"Timing.{f.name} must be >= {least}, got {value}")

    def describe(self) -> str:
        return (f"warm-up >= {self.warmup_s:g} s until the SM clock stops falling (at most {self.settle_max_s:g} s more), "
                f"then the median of a window >= {self.window_s:g} s; at least {self.min_warmup_calls} + "
                f"{self.min_window_calls} calls; burst = first <= {self.burst_calls} calls after a {self.pause_s:g} s pause")


TIMING_FLAGS = {  # flag of python -m verify: (Timing field, what it sets)
    "--warmup": ("warmup_s", "seconds of warm-up calls, at least"),
    "--settle-max": ("settle_max_s", "seconds of warm-up beyond --warmup while the SM clock is still falling, at most"),
    "--window": ("window_s", "seconds of timed calls whose median is the figure of record"),
    "--burst": ("burst_calls", "calls in the burst figure: the first of the warm-up"),
}


def add_timing_args(ap) -> None:
    """The timing flags of `python -m verify`; a bad value stops the command line before any GPU work."""
    g = ap.add_argument_group("timing (each implementation at each N)")
    for flag, (field, what) in TIMING_FLAGS.items():
        g.add_argument(flag, dest=field, type=_timing_value(field), default=getattr(Timing, field),
                       metavar="CALLS" if field.endswith("_calls") else "SECONDS",
                       help=f"{what} (default: %(default)s)")


def _timing_value(field: str):
    kind = int if Timing.__dataclass_fields__[field].type == "int" else float

    def parse(text: str):
        try:
            value = kind(text)
            Timing(**{field: value})  # the same checks as everywhere else
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    return parse


def timing_from_args(args) -> Timing:
    return Timing(**{field: getattr(args, field) for field, _ in TIMING_FLAGS.values()})


# ---- the timer's decisions (no GPU): fed finished calls, it says when warm-up and the window are over ----

class SteadyState:
    """Warm-up, then the window, decided one finished call at a time.

    A call is (flush_start, start, end): GPU seconds since the reference point, the L2 flush running
    from flush_start to start and the timed call from start to end. readings(a, b) returns the
    (SM MHz, W) readings taken between a and b; readings=None means there is no clock source.
    """

    def __init__(self, timing: Timing, readings=None):
        self.t, self.readings = timing, readings
        self.calls: list[tuple[float, float, float]] = []
        self.first_window: int | None = None  # index of the first window call, once warm-up is over
        self.ended_by: str | None = None      # what ended warm-up: "clock", "cap" or "no clock"

    def add(self, call: tuple[float, float, float]) -> None:
        self.calls.append(call)
        if self.first_window is None:
            self.ended_by = self._warmup_over()
            if self.ended_by:
                self.first_window = len(self.calls)

    def _warmup_over(self) -> str | None:
        t, now = self.t, self.calls[-1][2]
        if len(self.calls) < t.min_warmup_calls or now - self.calls[0][0] < t.warmup_s:
            return None
        if self.readings is None:
            return "no clock"
        if self._clock_stopped_falling(now):
            return "clock"
        return "cap" if now - self.calls[0][0] >= t.warmup_s + t.settle_max_s else None

    def _clock_stopped_falling(self, now: float) -> bool:
        # Means of two spans rather than a band around the last readings: under the power limit the clock
        # keeps stepping up and down, and only a downward trend means the card is still settling.
        s = self.t.settle_s
        before = self.readings(max(self.calls[0][0], now - 2 * s), now - s)  # warm-up readings only, not the pause
        last = self.readings(now - s, now)
        if len(before) < 2 or len(last) < 2:
            return False  # too few readings to tell yet
        mean = lambda rs: statistics.fmean(mhz for mhz, _ in rs)
        return mean(last) >= mean(before) - self.t.settle_mhz

    def _window(self) -> tuple[int, float]:
        """Calls in the window so far, and the GPU seconds they span (counted, not sliced: called every call)."""
        if self.first_window is None or self.first_window == len(self.calls):
            return 0, 0.0
        return len(self.calls) - self.first_window, self.calls[-1][2] - self.calls[self.first_window][0]

    @property
    def done(self) -> bool:
        calls, span = self._window()
        return calls >= self.t.min_window_calls and span >= self.t.window_s

    def per_call_s(self) -> float | None:
        """GPU seconds per call (flush included), from the calls so far."""
        return _span(self.calls) / len(self.calls) if self.calls else None

    def calls_needed(self) -> int:
        """How many more finished calls may still be needed: unbounded during warm-up, then what the window lacks."""
        if self.first_window is None:
            return sys.maxsize
        (calls, span), per_call = self._window(), self.per_call_s()
        by_time = math.ceil((self.t.window_s - span) / per_call) if per_call else 1
        return max(self.t.min_window_calls - calls, by_time, 0)

    def summary(self) -> dict:
        """The cell of the results file: the window's median and spread, the warm-up, the burst, the clock."""
        warm, win = self.calls[:self.first_window], self.calls[self.first_window:]
        burst = warm[:self.t.burst_calls]
        ms = sorted(_ms(win))
        out = {"median_ms": statistics.median(ms), "min_ms": ms[0], "p25_ms": _quantile(ms, 0.25),
               "p75_ms": _quantile(ms, 0.75), "max_ms": ms[-1], "window_calls": len(win), "window_s": _span(win),
               "idle_pct": 100 * _idle(win) / _span(win),
               "warmup_calls": len(warm), "warmup_s": _span(warm), "warmup_ended_by": self.ended_by,
               "burst_calls": len(burst), "burst_median_ms": statistics.median(_ms(burst))}
        window_readings = self.readings(win[0][0], win[-1][2]) if self.readings else []
        burst_readings = self.readings(burst[0][0], burst[-1][2]) if self.readings else []
        mhz = sorted(r[0] for r in window_readings)
        watts = [r[1] for r in window_readings if r[1] is not None]
        out |= {"sm_mhz_min": mhz[0] if mhz else None, "sm_mhz_median": statistics.median(mhz) if mhz else None,
                "sm_mhz_max": mhz[-1] if mhz else None, "power_w_median": statistics.median(watts) if watts else None,
                "clock_readings": len(mhz),
                "burst_sm_mhz_median": statistics.median(r[0] for r in burst_readings) if burst_readings else None}
        return out


def _span(calls) -> float:
    return calls[-1][2] - calls[0][0] if calls else 0.0


def _ms(calls) -> list[float]:
    return [(end - start) * 1e3 for _, start, end in calls]


def _idle(calls) -> float:
    """GPU seconds between one call's end and the next call's flush: the GPU waiting for the CPU (and the
    microsecond or two between two event records)."""
    return sum(max(0.0, b[0] - a[2]) for a, b in zip(calls, calls[1:]))


def _quantile(sorted_ms: list[float], f: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(f * len(sorted_ms)))]


def drive(gpu, state: SteadyState, ahead_s: float) -> SteadyState:
    """Keep about ahead_s of calls queued on the GPU (at least two, so it never waits for the CPU), feed each
    finished call to state, queue none that the window will not need, and stop when state is done.

    gpu.launch() queues one call and returns a handle; gpu.wait(handle) returns its (flush_start, start, end)
    once it has finished; gpu.drain() waits for everything queued."""
    in_flight: collections.deque = collections.deque()
    while not state.done:
        per_call = state.per_call_s()
        want = max(2, math.ceil(ahead_s / per_call)) if per_call else 2
        want = max(1, min(want, state.calls_needed()))
        while len(in_flight) < want:
            in_flight.append(gpu.launch())
        state.add(gpu.wait(in_flight.popleft()))
    gpu.drain()
    return state


# ---- the GPU side ----

class L2Flush:
    def __init__(self, nbytes: int = 256 << 20):
        import torch
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


class CudaCalls:
    """flush + fn on the current stream, between CUDA events; times are GPU seconds since construction."""

    def __init__(self, fn, flush: L2Flush):
        import torch
        self.torch, self.fn, self.flush = torch, fn, flush
        torch.cuda.synchronize()  # the GPU is idle, so the reference event completes as soon as it is queued
        self.host_t0 = time.perf_counter()
        self.ref = self._event()
        self.ref.record()

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def launch(self):
        events = self._event(), self._event(), self._event()
        events[0].record()
        self.flush()
        events[1].record()
        self.fn()
        events[2].record()
        return events

    def wait(self, events) -> tuple[float, float, float]:
        events[2].synchronize()
        flush_start, start = (self.ref.elapsed_time(e) / 1e3 for e in events[:2])
        # the call's own duration straight from its two events: a float32 time since ref (seconds in) has
        # steps of ~0.25 us, 0.1 % of a 0.2 ms call
        return flush_start, start, start + events[1].elapsed_time(events[2]) / 1e3

    def drain(self) -> None:
        self.torch.cuda.synchronize()


def parse_smi(line: str) -> tuple[float, float | None]:
    """'1755, 681.23' (nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits) -> (MHz, W)."""
    mhz, watts = (x.strip() for x in line.split(","))
    try:
        w = float(watts)
    except ValueError:  # '[N/A]' on boards that do not report power
        w = None
    return float(mhz), w


class ClockSampler:
    """Reads the SM clock (MHz) and board power (W) every period_s in a thread, from start to stop.

    Read only: no setting of the card is changed. NVML through torch.cuda.clock_rate / power_draw where
    nvidia-ml-py is installed, else nvidia-smi; source is None when neither answers. read= replaces the
    source (tests)."""

    def __init__(self, period_s: float = 0.02, read=None, source: str | None = None):
        self.source, self._read = (source, read) if read else self._find_source()
        t0 = time.perf_counter()
        if self._read:
            self._read()
        self.interval_s = period_s + time.perf_counter() - t0  # between readings: the wait, then one read
        self.period_s = period_s
        self._times: list[float] = []
        self._readings: list[tuple[float, float | None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _find_source():
        import torch
        device = torch.cuda.current_device()

        def power_w():
            return torch.cuda.power_draw(device) / 1e3  # mW -> W
        try:
            power_w()
        except Exception:  # a board that reports no power to NVML (some GeForce cards): the clock alone
            power_w = None

        def nvml():
            return float(torch.cuda.clock_rate(device)), power_w() if power_w else None  # MHz, W
        try:
            nvml()
            return "nvml", nvml
        except Exception:  # no nvidia-ml-py (ModuleNotFoundError) or an NVML error: try nvidia-smi
            pass
        query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
        for cmd in (query + ["-i", f"GPU-{torch.cuda.get_device_properties(device).uuid}"], query):
            def smi(cmd=cmd):
                lines = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip().splitlines()
                if len(lines) != 1:  # the plain query lists every GPU: usable only where there is one
                    raise ValueError(f"nvidia-smi listed {len(lines)} GPUs")
                return parse_smi(lines[0])
            try:
                smi()
                return "nvidia-smi", smi
            except (OSError, subprocess.SubprocessError, ValueError):
                continue
        return None, None

    def _loop(self):
        while not self._stop.wait(self.period_s):
            t_before = time.perf_counter()
            try:
                reading = self._read()
            except Exception:  # a failed reading is a gap in the record, not a reason to stop the benchmark
                continue
            with self._lock:
                self._times.append((t_before + time.perf_counter()) / 2)  # nvidia-smi takes tens of ms
                self._readings.append(reading)

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def between(self, t_from: float, t_to: float) -> list[tuple[float, float | None]]:
        """Readings taken in [t_from, t_to] (time.perf_counter seconds)."""
        with self._lock:
            return self._readings[bisect.bisect_left(self._times, t_from):bisect.bisect_right(self._times, t_to)]


def fit_to_clock(timing: Timing, interval_s: float) -> Timing:
    """A settle span long enough for at least two clock readings (nvidia-smi reads far slower than NVML)."""
    least = 2.5 * interval_s
    return timing if timing.settle_s >= least else dataclasses.replace(timing, settle_s=least)


def measure(fn, flush: L2Flush, sampler: ClockSampler, timing: Timing) -> dict:
    """Time fn in steady state (module docstring); returns SteadyState.summary() and the clock's source."""
    import torch
    fn()  # lazy set-up outside the timing; an implementation that cannot run raises here
    torch.cuda.synchronize()
    time.sleep(timing.pause_s)
    gpu = CudaCalls(fn, flush)
    readings = None if sampler.source is None else (lambda a, b: sampler.between(gpu.host_t0 + a, gpu.host_t0 + b))
    cell = drive(gpu, SteadyState(timing, readings), timing.ahead_s).summary()
    cell["clock_source"] = sampler.source
    return cell


def log_line(label: str, cell: dict) -> str:
    """One measurement for the verbose log: sustained and burst figures, the calls, the clock it ran at."""
    clock = (f"SM {cell['sm_mhz_min']:.0f}-{cell['sm_mhz_max']:.0f} MHz (median {cell['sm_mhz_median']:.0f})"
             if cell.get("sm_mhz_median") is not None else "SM clock not read")
    if cell.get("power_w_median") is not None:
        clock += f", {cell['power_w_median']:.0f} W"
    ended = {"clock": "clock settled", "cap": "CAP: clock still falling", "no clock": "no clock"}[cell["warmup_ended_by"]]
    idle = f", GPU idle {cell['idle_pct']:.1f}%" if cell["idle_pct"] >= 0.1 else ""
    return (f"  {label:<34} {cell['median_ms']:9.3f} ms {cell['tflops']:7.1f} TFLOP/s (burst {cell['burst_tflops']:.1f})"
            f"  {cell['window_calls']} calls/{cell['window_s']:.2f} s after {cell['warmup_calls']}/{cell['warmup_s']:.2f} s "
            f"warm-up ({ended}){idle}  {clock}")


def sdpa_fn(backend_name: str, q, k, v, **kwargs):
    """SDPA forced to one backend; kwargs (is_causal, enable_gqa) go to the call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return fn


# torch's own lines around the reasons it gives for refusing a call: left out of the reason a cell records
SDPA_BOILERPLATE = ("kernel not used because", "has been runtime disabled", "was not compiled with")


def refusal(fn) -> str | None:
    """One call of fn: None where it runs, else why not, in one line: torch's reasons for refusing an SDPA call (the
    warnings it gives before "No available kernel") and the error itself. Any other exception propagates."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except RuntimeError as e:
            reasons = [str(w.message).split(" (Triggered internally")[0].strip().splitlines()[0] for w in caught
                       if str(w.message).strip() and not any(b in str(w.message) for b in SDPA_BOILERPLATE)]
            return "; ".join(dict.fromkeys([*reasons, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__]))
    return None


def with_tflops(cell: dict, work: int) -> dict:
    cell["tflops"] = work / (cell["median_ms"] * 1e-3) / 1e12
    cell["burst_tflops"] = work / (cell["burst_median_ms"] * 1e-3) / 1e12
    return cell


def causal_fns(table: str, q, k, v, step: CausalStep, fa3) -> tuple[dict, dict]:
    """The causal table's rows at these inputs (q: [B, H, N, 128]; k, v: [B, H_kv, N, 128]): ({name: fn}, {name: why}
    for a row that cannot take them). fa3: fa3_attention()'s function, or None."""
    names = causal_names(step.name)[table]
    grouped = q.shape[1] != k.shape[1]
    fns, why = {}, {}
    if grouped and not step.gqa:
        why[names[0]] = f"{step.name} takes no grouped key/value heads (info['gqa'] is False)"
    else:
        fns[names[0]] = lambda: step.attention(q, k, v, causal="top_left")
    fns[names[1]] = sdpa_fn(SDPA_BACKENDS["sdpa_cudnn"], q, k, v, is_causal=True, **({"enable_gqa": True} if grouped else {}))
    if fa3:  # on [B, N, H, D] copies, FA3's own layout, made once outside the timing
        qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        fns[names[2]] = lambda: fa3(qt, kt, vt, causal="top_left")
    return fns, why


def causal_method(step: str, seqlens: list[int]) -> dict:
    """What the results file says of the causal table: the step, the N, each table's heads, the mask, the FLOPs."""
    return {"step": step, "seqlens": list(seqlens), "mask": "top_left (SDPA's is_causal=True: row i sees keys 0..i)",
            "flops": "half the dense 4*B*H*N^2*d", "rows": causal_names(step),
            "tables": {t: {"heads": h, "heads_kv": hk} for t, (h, hk) in CAUSAL_TABLES.items()}}


def run(impls: dict, seqlens: list[int], budget_s: float | None = None, log=print, timing: Timing | None = None,
        causal: CausalStep | None = None, breadth: BreadthStep | None = None) -> dict:
    """impls: {name: attention(q, k, v)}. Returns {"timings": {name: {N: cell}}, "unavailable": {name: why},
    "not_timed": {name: {N: why}} (a step that does not take a shape, e.g. a seqlen that is not a multiple of its
    tile), "method": the timing settings}, with the SDPA backends, FA3 (where installed) and the cuBLAS GEMM added.
    causal: the step of the causal table (module docstring), timed at causal_seqlens(seqlens) with SDPA cuDNN and FA3
    beside it; then "causal" says what the table is (causal_method), and a cell that torch refuses (SDPA cuDNN
    without grouped heads in some torch) is "not timed" with torch's reason, never run by another backend.
    breadth: the step of the breadth tables (module docstring), timed at causal_seqlens(seqlens) the same way; then
    "breadth" says what they are (breadth_method).

    budget_s, the old benchmark's seconds of timed calls, sets the window's length (verify/variants.py)."""
    import torch
    timing = timing or Timing()
    if budget_s is not None:
        timing = dataclasses.replace(timing, window_s=budget_s)
    flush = L2Flush()
    fa3, why_not_fa3 = fa3_attention()
    c_seqlens = causal_seqlens(seqlens) if causal else []
    c_names = causal_names(causal.name) if c_seqlens else {}
    b_seqlens = causal_seqlens(seqlens) if breadth else []
    b_names = breadth_names(breadth.name, breadth.tables) if b_seqlens else {}
    results: dict[str, dict] = {name: {} for name in [*impls, *SDPA_BACKENDS, *PEERS,
                                                      *(n for ns in [*c_names.values(), *b_names.values()] for n in ns)]}
    errors: dict[str, str] = {} if fa3 else {"fa3": why_not_fa3, **{f"fa3_{t}": why_not_fa3 for t in [*c_names, *b_names]}}
    not_timed: dict[str, dict] = {}
    if not fa3:
        log(f"  fa3              {why_not_fa3}")
    if causal and not c_seqlens:
        log(f"  causal table: not timed (it runs at N = {', '.join(map(str, CAUSAL_SEQLENS))}; this run has none of them)")
    t_start = time.perf_counter()

    def time_cells(fns: dict, n: int, shape: tuple, work: int, label: str) -> None:
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                why = refusal(fn) if name.startswith("sdpa_") and name not in SDPA_BACKENDS else None
                if why:  # torch refuses this call on the backend asked for: said, never run on another one
                    not_timed.setdefault(name, {})[n] = why
                    log(f"  N={n:<6} {name}: not timed: {why}")
                    continue
                cell = measure(fn, flush, sampler, timing)
            except ValueError as e:  # the binding refuses this shape (e.g. N not a multiple of the step's tile)
                not_timed.setdefault(name, {})[n] = str(e).splitlines()[0]
                log(f"  N={n:<6} {name}: not timed: {not_timed[name][n]}")
                continue
            except RuntimeError as e:  # a backend torch cannot run here: say so, keep going
                errors[name] = str(e).splitlines()[0]
                log(f"  {name:<16} unavailable: {errors[name]}")
                continue
            cell["batch"], cell["heads"] = shape[0], shape[1]
            if len(shape) > 2:
                cell["heads_kv"] = shape[2]
            results[name][n] = with_tflops(cell, work)
            log(log_line(f"N={n:<6} {label} {name}", cell))

    with ClockSampler() as sampler:
        if sampler.source:
            timing = fit_to_clock(timing, sampler.interval_s)
        log(f"  timing: {timing.describe()}; SM clock and power from {sampler.source or 'nowhere (no NVML, no nvidia-smi)'}"
            + (f", read every {sampler.interval_s * 1e3:.0f} ms (settle spans {timing.settle_s:.2f} s)" if sampler.source else ""))
        for n in seqlens:
            batch, heads, _ = shape_of(n)
            gen = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = (torch.randn(batch, heads, n, HEAD_DIM, device="cuda", generator=gen).add_(0.5).to(torch.bfloat16)
                       for _ in range(3))
            fns = {name: (lambda f=f: f(q, k, v)) for name, f in impls.items()}
            for name, backend in SDPA_BACKENDS.items():
                fns[name] = sdpa_fn(backend, q, k, v)
            if fa3:  # on [B, N, H, D] copies, FA3's own layout, made once outside the timing
                qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
                fns["fa3"] = lambda: fa3(qt, kt, vt)
            time_cells(fns, n, (batch, heads), flops(batch, heads, n), f"batch={batch:<3} heads={heads:<3}")
        for table in c_names:
            for n in c_seqlens:
                batch, heads, heads_kv, _ = causal_shape_of(table, n)
                gen = torch.Generator(device="cuda").manual_seed(n + heads_kv)
                q, k, v = (torch.randn(batch, h, n, HEAD_DIM, device="cuda", generator=gen).add_(0.5).to(torch.bfloat16)
                           for h in (heads, heads_kv, heads_kv))
                fns, cannot = causal_fns(table, q, k, v, causal, fa3)
                for name, why in cannot.items():
                    not_timed.setdefault(name, {})[n] = why
                    log(f"  N={n:<6} {name}: not timed: {why}")
                time_cells(fns, n, (batch, heads, heads_kv), causal_flops(batch, heads, n),
                           f"batch={batch:<3} heads={heads}/{heads_kv:<3} causal")
        for table in b_names:
            kind, mask = BREADTH_TABLES[table.removesuffix("_causal")], table.endswith("_causal")
            dtype, d = getattr(torch, kind["dtype"]), kind["head_dim"]
            for n in b_seqlens:
                batch, heads, _ = shape_of(n)
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v = (torch.randn(batch, heads, n, d, device="cuda", generator=gen).add_(0.5).to(dtype)
                           for _ in range(3))
                time_cells(breadth_fns(table, q, k, v, breadth, fa3), n, (batch, heads),
                           (causal_flops if mask else flops)(batch, heads, n, d), f"batch={batch:<3} heads={heads:<3} {table}")
        a, b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gemm = with_tflops(measure(lambda: a @ b, flush, sampler, timing), 2 * GEMM_N**3)
        log(log_line(LABELS["cublas_gemm"], gemm))
    results["cublas_gemm"] = {str(GEMM_N): gemm}
    cells = [c for cs in results.values() for c in cs.values()]
    ended = collections.Counter(c["warmup_ended_by"] for c in cells)
    log(f"  benchmark: {time.perf_counter() - t_start:.0f} s, {len(cells)} measurements; warm-up ended by the clock settling "
        f"{ended['clock']}x, at the limit with the clock still falling {ended['cap']}x, without clock readings {ended['no clock']}x")
    out = {"timings": results, "unavailable": errors, "not_timed": not_timed,
           "method": dataclasses.asdict(timing) | {"clock_source": sampler.source}}
    if c_names:
        out["causal"] = causal_method(causal.name, c_seqlens)
    if b_names:
        out["breadth"] = breadth_method(breadth, b_seqlens)
    return out
