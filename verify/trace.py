"""python -m verify.trace: measured timelines of the warp-specialized steps, one PNG per step.

    python -m verify.trace                           # every step with trace points; batch 1, 16 heads, N = 4096
    python -m verify.trace --steps 11-12 --zoom 4-8  # a subset, another zoom
    python -m verify.trace --replay DIR              # no GPU: redraw from the stepNN.json files a run wrote

Each step is built with -DFLASHLADDER_TRACE into build/trace/ (common/trace.cuh: lane 0 of every warp of CTA
(0, 0, 0) records its trace points (TRACE_EVENT, TRACE_SPAN) with clock64 and %globaltimer) and run once, after a warm-up, in a
process of its own with a time limit: a kernel that hangs fails its step, and the run goes on. Per step it
writes to --out (default results/<gpu>/timeline/): stepNN.json, the raw events; stepNN.png, the timeline of
the producer and the first warp of each consumer warpgroup, the whole run of CTA 0 above a zoom on a few K/V
tiles; and it adds the step to summary.json and the table printed last: how much of the time at least one
consumer has a GEMM in flight (a proxy for busy tensor cores), the mean softmax and GEMM durations, and CTA
0's time per work tile beside the untraced kernel's time x SMs / work tiles (one CTA per SM at a time in these
steps): what the tracing costs.

Time is clock64, the SM's cycle counter, in ns by the ratio of clock64 to %globaltimer fitted over the run:
the global timer ticks in steps of up to ~1 us on some GPUs, too coarse for phases of ~1 us. A GEMM is "in
flight" from its commit to the wgmma_wait_group after which it is complete, an upper bound of its time on the
tensor cores: a wait that comes late (step12's wait for P V, after the softmax) ends it late. Its start is
recorded once the warp has issued the whole block and, from step11 on, handed the turn over (an event between
two commit groups makes ptxas fence the second), so it starts a little late too.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from verify import steps as steps_mod

build_step = steps_mod.build_step
ROOT = steps_mod.ROOT
HEADER = build_step.COMMON / "trace.cuh"
TRACE_DIR = ROOT / "build" / "trace"  # holds flashladder/stepNN/ packages built with -DFLASHLADDER_TRACE
TRACE_FLAGS = ("-DFLASHLADDER_TRACE",)  # added to build_step.NVCC_FLAGS
PROG = "python -m verify.trace"
FORMAT = "flashladder-trace-1"  # the raw file's layout (stepNN.json)
COLUMNS = ["region", "warp", "event", "arg", "clock", "globaltimer", "smid"]

# What the events mean to the drawing (their ids come from common/trace.cuh, never typed here).
SPANS = {"SOFTMAX": "softmax", "RESCALE": "rescale", "FULL_WAIT": "full_wait", "TURN_WAIT": "turn_wait",
         "EPILOGUE": "epilogue", "EMPTY_WAIT": "empty_wait"}  # NAME_BEGIN .. NAME_END -> a bar of this kind
TICKS = {"TMA_Q": "Q", "TMA_K": "K", "TMA_V": "V"}           # a TMA copy issued: a tick
GEMM_WAITS = {"GEMM_WAITED_ALL": 0, "GEMM_WAITED_ALL_BUT_1": 1}  # wgmma_wait_group<N>: N groups may still run
KNOWN = {*(f"{s}_{e}" for s in SPANS for e in ("BEGIN", "END")), *TICKS, "GEMM_ISSUED", *GEMM_WAITS}
STYLE = {  # kind -> (color, legend)
    "gemm": ("#1f77b4", "GEMM in flight (commit -> wait_group)"),
    "softmax": ("#ff7f0e", "softmax"),
    "rescale": ("#f5c542", "rescale O, P to bf16 (softmax, 2nd part)"),
    "full_wait": ("#b0b0b0", "waiting on a full barrier (data)"),
    "turn_wait": ("#c5a3e0", "waiting for its turn (ping-pong)"),
    "epilogue": ("#2ca02c", "epilogue"),
    "empty_wait": ("#8c564b", "producer waiting on an empty slot"),
}
TICK_COLORS = {"Q": "#17becf", "K": "#000000", "V": "#d62728"}
TICK_HEIGHTS = {"Q": (0.54, 0.96), "K": (0.54, 0.75), "V": (0.75, 0.96)}  # within a lane: K below V, Q across both


class TraceError(ValueError):
    """A trace that cannot be drawn truthfully (dropped, out-of-order or unpaired events ...): the message says why."""


# ---- the events and the trace points ----

def event_names(header: Path = HEADER) -> dict[int, str]:
    """{id: name without TRACE_} from the TraceEvent enum of common/trace.cuh."""
    body = re.search(r"enum\s+TraceEvent\b[^{]*\{(.*?)\};", header.read_text(), re.S)
    if not body:
        raise RuntimeError(f"{header}: no `enum TraceEvent {{ ... }};` found")
    names = {int(v): n for n, v in re.findall(r"\bTRACE_(\w+)\s*=\s*(\d+)", body.group(1))}
    missing = KNOWN - set(names.values())
    if missing:
        raise RuntimeError(f"{header}: the TraceEvent enum lacks {', '.join(sorted(missing))}, which verify/trace.py draws")
    return names


# A trace point: TRACE_EVENT(TRACE_X, arg); records X there; TRACE_SPAN(TRACE_X_BEGIN, arg); records X_BEGIN there
# and X_END where the enclosing scope closes (common/trace.cuh: the enum's next value). One statement per line.
TRACE_LINE = re.compile(r"\s*TRACE_(EVENT|SPAN)\(TRACE_(\w+), [^;]+\);\s*")


def trace_points(kernel_cu: Path) -> list[str]:
    """The events a kernel.cu marks, one per TRACE_EVENT line and two (X_BEGIN, X_END) per TRACE_SPAN line. Each
    must be a one-line statement of its own, so that the source without those lines is exactly the kernel without
    tracing (verify/tests/test_trace.py)."""
    return points_in(kernel_cu.read_text(), str(kernel_cu))


def points_in(source: str, where: str = "kernel.cu") -> list[str]:
    """trace_points() of a kernel's source text; `where` names it in the errors."""
    kernel_cu = where
    ids = {name: i for i, name in event_names().items()}
    points = []
    for number, line in enumerate(source.splitlines(), 1):
        if "TRACE_EVENT" not in line and "TRACE_SPAN" not in line:
            continue
        m = TRACE_LINE.fullmatch(line)
        if not m:
            raise ValueError(f"{kernel_cu}:{number}: TRACE_EVENT and TRACE_SPAN must be one-line statements of their own: "
                             f"{line.strip()}")
        kind, name = m.groups()
        if name not in ids:
            raise ValueError(f"{kernel_cu}:{number}: TRACE_{name} is not in common/trace.cuh's TraceEvent enum")
        if kind == "EVENT":
            points.append(name)
            continue
        end = name[:-len("BEGIN")] + "END" if name.endswith("_BEGIN") else None
        if end is None or ids.get(end) != ids[name] + 1:
            raise ValueError(f"{kernel_cu}:{number}: TRACE_SPAN takes a TRACE_X_BEGIN whose next enum value is "
                             f"TRACE_X_END (common/trace.cuh), not TRACE_{name}")
        points += [name, end]
    return points


def step_dirs() -> dict[str, Path]:
    return {build_step.step_name(d): d for d in build_step.find_steps(ROOT)}


def traced_steps(steps: list[str] | None = None) -> list[str]:
    """Of `steps` (default: all), those whose kernel.cu has trace points."""
    dirs = step_dirs()
    return [s for s in (steps or list(dirs)) if trace_points(dirs[s] / "kernel.cu")]


# ---- the trace build: build_step.compile_step, plus -DFLASHLADDER_TRACE ----

def build(step: str, force: bool = False) -> Path:
    """Build the trace variant of `step` into build/trace/flashladder/<step>/ (cached by content, the flag
    included, as every build). Returns the folder."""
    out = TRACE_DIR / "flashladder" / step
    build_step.compile_step(step_dirs()[step], out, force=force, extra_nvcc_flags=TRACE_FLAGS)
    return out


def wgmma_warnings(ptxas_report: str) -> list[str]:
    """ptxas lines that say it changed how the wgmma run: serialized them or injected a warpgroup.arrive (a fence)."""
    return [ln.strip() for ln in ptxas_report.splitlines()
            if re.search(r"wgmma|warpgroup|gmma", ln, re.I) and not re.search(r"Compiling entry|Function properties", ln)]


# ---- recording (in a process of its own, on the GPU) ----

def record(step: str, shape: tuple[int, int, int], raw_path: Path) -> None:
    """Run the trace build of `step` once on q, k, v of `shape` (batch, heads, seqlen) and write the raw events."""
    import numpy as np
    import torch

    from verify.checks import make_inputs
    sys.path.insert(0, str(TRACE_DIR))
    mod = importlib.import_module(f"flashladder.{step}")
    if not Path(mod.__file__).resolve().is_relative_to(TRACE_DIR.resolve()):
        raise RuntimeError(f"imported flashladder.{step} from {mod.__file__}, not from the trace build in {TRACE_DIR}")
    lib = ctypes.CDLL(mod.info["library"])  # the library the binding loaded (same path: the same handle)
    for name in ("flashladder_trace_reset", "flashladder_trace_counts", "flashladder_trace_read_warp"):
        if not hasattr(lib, name):
            raise RuntimeError(f"{mod.info['library']} exports no {name}: it is not a trace build (-DFLASHLADDER_TRACE)")
    lib.flashladder_trace_counts.argtypes = [ctypes.POINTER(ctypes.c_uint)]
    lib.flashladder_trace_read_warp.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]

    def check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: {lib.flashladder_error_string(err).decode()} (cudaError {err})")

    lib.flashladder_error_string.restype = ctypes.c_char_p
    max_warps, per_warp, words = (lib.flashladder_trace_max_warps(), lib.flashladder_trace_events_per_warp(),
                                  lib.flashladder_trace_words_per_event())
    batch, heads, seqlen = shape
    q, k, v = make_inputs(batch, heads, seqlen, seqlen)
    for _ in range(3):  # warm-up: module load, the shared-memory attribute, clocks up
        mod.attention(q, k, v)
    torch.cuda.synchronize()
    check(lib.flashladder_trace_reset(), "flashladder_trace_reset")
    o, lse = mod.attention(q, k, v)  # the one traced launch
    torch.cuda.synchronize()
    if not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
        raise RuntimeError(f"{step}: the traced launch wrote non-finite output")
    counts = (ctypes.c_uint * max_warps)()
    check(lib.flashladder_trace_counts(counts), "flashladder_trace_counts")
    names, rows = event_names(), []
    for region, attempted in enumerate(counts):
        n = min(attempted, per_warp)
        if n == 0:
            continue
        buf = (ctypes.c_uint64 * (n * words))()
        check(lib.flashladder_trace_read_warp(region, buf, n), "flashladder_trace_read_warp")
        rows += decode(region, np.frombuffer(buf, dtype=np.uint64).reshape(n, words).tolist(), names)
    import binding  # common/binding/ (on sys.path through verify.steps): the ABI every step's library speaks
    raw = {"format": FORMAT, "step": step, "shape": list(shape), "gpu": torch.cuda.get_device_name(),
           "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "work_tiles": -(-seqlen // mod.info["tile_q"]) * heads * batch,
           "kv_tiles": -(-seqlen // mod.info["tile_k"]),  # every step's K/V tile, whatever kernel runs
           "untraced_us": time_untraced(binding, steps_mod.DEV / "flashladder" / step / "_kernel.so", q, k, v),
           "events_per_warp": per_warp, "attempted": {str(w): n for w, n in enumerate(counts) if n},
           "columns": COLUMNS, "events": rows}
    raw_path.write_text(json.dumps(raw, separators=(",", ":")))


def decode(region: int, events: list[list[int]], names: dict[int, str]) -> list[list]:
    """Rows of COLUMNS from one warp's region of the buffer (each event: the words of common/trace.cuh's layout)."""
    rows = []
    for clock, globaltimer, info, smid, *_ in events:
        event = (info >> 16) & 0xFFFF
        rows.append([region, info & 0xFFFF, names.get(event, f"UNKNOWN_{event}" if event else "UNWRITTEN"),
                     ctypes.c_int32(info >> 32).value, clock, globaltimer, smid])  # the argument is a signed int
    return rows


def time_untraced(binding, dev_so: Path, q, k, v, reps: int = 20) -> float:
    """Median time (us) of the step's normal build on the same inputs, for the cost of tracing."""
    import torch
    lib = binding.load_library(dev_so)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    params = binding.make_params(q, k, v, o, lse, 1.0 / math.sqrt(binding.HEAD_DIM))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    times = []
    for i in range(reps + 3):  # 3 warm-up launches
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        err = lib.flashladder_fwd(ctypes.byref(params), stream)
        end.record()
        if err != 0:
            raise RuntimeError(f"{dev_so}: launch failed: {lib.flashladder_error_string(err).decode()}")
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


# ---- analysis: validate the raw events, put them on one time axis, pair them into bars ----

@dataclass
class Bar:
    kind: str     # a key of STYLE
    start: float  # us since CTA 0's first event
    end: float
    arg: int      # the K/V tile (or work tile) of the event that opened it
    work: int     # which of the warp's work tiles (0, 1, ...: step14 runs several per CTA)


@dataclass
class Timeline:
    step: str
    raw: dict
    lanes: dict[int, str]                 # warp -> label, drawn top to bottom: the producer, then each consumer
    consumers: list[int]                  # the lanes that are consumers
    bars: dict[int, list[Bar]] = field(default_factory=dict)
    ticks: dict[int, list[tuple[str, float, int]]] = field(default_factory=dict)  # warp -> (Q/K/V, t, arg)
    ns_per_cycle: float = 0.0
    globaltimer_step_ns: float = 0.0
    fit_residual_ns: float = 0.0          # the largest |globaltimer - fit| over the events
    span_us: float = 0.0
    work_tiles: int = 0                   # work tiles CTA 0 ran


def _fail(raw: dict, msg: str):
    raise TraceError(f"{raw.get('step', '?')}: {msg}")


def analyse(raw: dict) -> Timeline:
    """Check the raw events (nothing dropped, in order per warp, one SM, every begin with its end, every GEMM
    waited for) and turn them into bars and ticks on one time axis. Raises TraceError naming the first problem."""
    if raw.get("format") != FORMAT:
        _fail(raw, f"not a {FORMAT} file (format {raw.get('format')!r})")
    cap = raw["events_per_warp"]
    dropped = {int(w): n - cap for w, n in raw["attempted"].items() if n > cap}
    if dropped:
        _fail(raw, f"{sum(dropped.values())} events dropped (warps {sorted(dropped)} each attempted more than the "
                   f"{cap} a warp's buffer holds): trace a shorter run (--shape)")
    rows = [dict(zip(raw["columns"], r)) for r in raw["events"]]
    if not rows:
        _fail(raw, "no events recorded")
    by_warp: dict[int, list[dict]] = {}
    for r in rows:
        if r["warp"] != r["region"]:
            _fail(raw, f"an event in warp {r['region']}'s region says it is from warp {r['warp']}")
        if r["event"] not in KNOWN:
            _fail(raw, f"warp {r['warp']}: event {r['event']} is not one verify/trace.py knows"
                       + (" (a slot no event wrote: the warp's count did not start from 0)" if r["event"] == "UNWRITTEN" else ""))
        by_warp.setdefault(r["warp"], []).append(r)
    for w, evs in by_warp.items():
        if len(evs) != raw["attempted"].get(str(w), 0):
            _fail(raw, f"warp {w}: {len(evs)} events read, {raw['attempted'].get(str(w), 0)} recorded")
        for a, b in zip(evs, evs[1:]):
            for clock in ("clock", "globaltimer"):
                if b[clock] < a[clock]:
                    _fail(raw, f"warp {w}: events out of order: {b['event']} (tile {b['arg']}) has {clock} {b[clock]}, "
                               f"earlier than the {a['event']} before it ({a[clock]})")
    sms = {r["smid"] for r in rows}
    if len(sms) != 1:
        _fail(raw, f"events from SMs {sorted(sms)}: the clocks of two SMs cannot be compared (one CTA runs on one SM)")

    # One time axis: clock64 in ns by a least-squares fit to %globaltimer over the whole run.
    import numpy as np
    clocks = np.array([r["clock"] for r in rows], dtype=np.float64)
    timers = np.array([r["globaltimer"] for r in rows], dtype=np.float64)
    c0, t0 = clocks.min(), timers.min()
    steps = np.diff(np.unique(timers))
    if len(steps) < 2:
        _fail(raw, "%globaltimer barely moved during the run: too short to time clock64 against it (a longer --shape)")
    slope, intercept = np.polyfit(clocks - c0, timers - t0, 1)
    mhz = 1e3 / slope
    if not 100 <= mhz <= 5000:
        _fail(raw, f"clock64 against %globaltimer gives an SM clock of {mhz:.0f} MHz, not a GPU's: the timestamps disagree")
    tl = Timeline(step=raw["step"], raw=raw, lanes={}, consumers=[], ns_per_cycle=float(slope),
                  globaltimer_step_ns=float(steps.min()),
                  fit_residual_ns=float(np.abs(timers - t0 - (slope * (clocks - c0) + intercept)).max()),
                  span_us=float((clocks.max() - c0) * slope / 1e3))
    us = lambda r: (r["clock"] - c0) * slope / 1e3

    producers, consumers = [], []
    for w, evs in sorted(by_warp.items()):
        bars, ticks, open_spans, gemms, work = [], [], {}, [], 0
        for r in evs:
            name, t = r["event"], us(r)
            if name in TICKS:
                if name == "TMA_Q" and any(k == "Q" for k, *_ in ticks):
                    work += 1  # the producer starts its next work tile
                ticks.append((TICKS[name], t, r["arg"]))
            elif name == "GEMM_ISSUED":
                gemms.append((t, r["arg"]))
            elif name in GEMM_WAITS:
                if len(gemms) <= GEMM_WAITS[name]:
                    _fail(raw, f"warp {w}: {name} (tile {r['arg']}) with {len(gemms)} GEMM group(s) in flight: "
                               "nothing for it to wait for (a misplaced trace point?)")
                while len(gemms) > GEMM_WAITS[name]:
                    start, arg = gemms.pop(0)
                    bars.append(Bar("gemm", start, t, arg, work))
            else:
                span, edge = name.rsplit("_", 1)
                if edge == "BEGIN":
                    if span in open_spans:
                        _fail(raw, f"warp {w}: {name} (tile {r['arg']}) while the {span} begun at tile "
                                   f"{open_spans[span][1]} has not ended")
                    open_spans[span] = (t, r["arg"])
                else:
                    if span not in open_spans:
                        _fail(raw, f"warp {w}: {name} (tile {r['arg']}) without a {span}_BEGIN before it")
                    start, arg = open_spans.pop(span)
                    bars.append(Bar(SPANS[span], start, t, arg, work))
                    if span == "EPILOGUE":
                        work += 1  # the consumer's next work tile
        if open_spans:
            _fail(raw, f"warp {w}: {', '.join(s + '_BEGIN' for s in open_spans)} never ended")
        if gemms:
            _fail(raw, f"warp {w}: {len(gemms)} GEMM group(s) issued and never waited for")
        tl.bars[w], tl.ticks[w] = bars, ticks
        if ticks:
            producers.append(w)
        if any(b.kind == "gemm" for b in bars):
            consumers.append(w)
    if not producers or not consumers:
        _fail(raw, f"expected a producer warp (TMA ticks) and consumer warps (GEMMs); found producers {producers}, "
                   f"consumers {consumers}")
    first_of_group: dict[int, int] = {}  # warpgroup (4 warps) -> its first warp
    for w in consumers:
        first_of_group.setdefault(w // 4, w)
    tl.lanes = {producers[0]: f"producer (warp {producers[0]})",
                **{w: f"consumer {i} (warp {w})" for i, w in enumerate(first_of_group.values())}}
    tl.consumers = list(first_of_group.values())
    tl.work_tiles = sum(1 for k, *_ in tl.ticks[producers[0]] if k == "Q")
    return tl


def zoom_window(tl: Timeline, lo: int, hi: int) -> tuple[float, float]:
    """From the softmax of K/V tile `lo` to the end of that of tile `hi` (first work tile, consumer lanes)."""
    soft = [b for w in tl.consumers for b in tl.bars[w] if b.kind in ("softmax", "rescale") and b.work == 0]
    starts = [b.start for b in soft if b.kind == "softmax" and b.arg == lo]
    ends = [b.end for b in soft if b.arg == hi]
    if not starts or not ends:
        tiles = sorted({b.arg for b in soft})
        raise TraceError(f"{tl.step}: --zoom {lo}-{hi}: the first work tile of CTA 0 has K/V tiles "
                         f"{tiles[0] if tiles else '-'}-{tiles[-1] if tiles else '-'}; choose tiles among them")
    return min(starts), max(ends)


def _union_us(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    total, cur = 0.0, t0
    for s, e in sorted(intervals):
        s, e = max(s, cur), min(e, t1)
        if e > s:
            total, cur = total + e - s, e
    return total


def summarize(tl: Timeline, window: tuple[float, float]) -> dict:
    """The numbers printed beside each timeline (durations in us; shares of the time in [0, 1])."""
    bars = [b for w in tl.consumers for b in tl.bars[w]]
    gemm = [(b.start, b.end) for b in bars if b.kind == "gemm"]

    def mean(kind):
        d = [b.end - b.start for b in bars if b.kind == kind]
        return sum(d) / len(d) if d else None

    def share(kind):
        return sum(b.end - b.start for b in bars if b.kind == kind) / (tl.span_us * len(tl.consumers))

    raw = tl.raw
    return {"gpu": raw["gpu"], "shape": raw["shape"], "clock_mhz": 1e3 / tl.ns_per_cycle,
            "globaltimer_step_ns": tl.globaltimer_step_ns, "fit_residual_ns": tl.fit_residual_ns,
            "span_us": tl.span_us, "work_tiles_cta0": tl.work_tiles, "zoom_us": list(window),
            "gemm_in_flight_share": _union_us(gemm, 0.0, tl.span_us) / tl.span_us,
            "gemm_in_flight_share_zoom": _union_us(gemm, *window) / (window[1] - window[0]),
            "gemm_mean_us": mean("gemm"), "softmax_mean_us": mean("softmax"), "rescale_mean_us": mean("rescale"),
            "full_wait_share": share("full_wait"), "turn_wait_share": share("turn_wait"),
            "us_per_work_tile_traced": tl.span_us / tl.work_tiles,
            "us_per_work_tile_untraced": raw["untraced_us"] * raw["sm_count"] / raw["work_tiles"]}


# ---- drawing ----

def draw(tl: Timeline, zoom: tuple[int, int], window: tuple[float, float], summary: dict, path: Path | None = None):
    """The timeline: the whole run of CTA 0 above the zoom; one lane per warp role (a GEMM strip above a strip of
    what the warp itself does), TMA issues as ticks on the producer's lane. Returns the (closed) figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 1, figsize=(16, 7.5), dpi=120)
    lanes = list(tl.lanes)
    for ax, (t0, t1), zoomed in ((axes[0], (0.0, tl.span_us), False), (axes[1], window, True)):
        for i, w in enumerate(lanes):
            y = len(lanes) - 1 - i  # the producer on top
            own = [b for b in tl.bars[w] if b.kind != "gemm" and b.end >= t0 and b.start <= t1]
            for kind in STYLE:
                spans = [(b.start, b.end - b.start) for b in own if b.kind == kind]
                if spans:
                    ax.broken_barh(spans, (y + 0.08, 0.4), facecolors=STYLE[kind][0], edgecolor="none")
            gemms = sorted((b for b in tl.bars[w] if b.kind == "gemm" and b.end >= t0 and b.start <= t1), key=lambda b: b.start)
            track_end: list[float] = []  # overlapping groups (step12's S and P V) on separate tracks
            placed = []
            for b in gemms:
                track = next((k for k, e in enumerate(track_end) if e <= b.start), len(track_end))
                track_end[track:track + 1] = [b.end]
                placed.append((track, b))
            tracks = max(1, len(track_end))
            for track, b in placed:
                h = 0.4 / tracks
                ax.broken_barh([(b.start, b.end - b.start)], (y + 0.54 + track * h, h * 0.9), facecolors=STYLE["gemm"][0],
                               edgecolor="white", linewidth=0.3)
            for kind, color in TICK_COLORS.items():
                ts = [t for k, t, _ in tl.ticks.get(w, []) if k == kind and t0 <= t <= t1]
                if ts:
                    lo, hi = TICK_HEIGHTS[kind]
                    ax.vlines(ts, y + lo, y + hi, colors=color, linewidth=0.8)
            if zoomed:
                for b in own:
                    if b.kind == "softmax" and t0 <= b.start <= t1:
                        ax.text((b.start + b.end) / 2, y + 0.28, str(b.arg), ha="center", va="center", fontsize=6)
        ax.set_yticks([len(lanes) - 1 - i + 0.5 for i in range(len(lanes))], [tl.lanes[w] for w in lanes])
        ax.set_ylim(0, len(lanes))
        margin = 0.02 * (t1 - t0)
        ax.set_xlim(t0 - margin, t1 + margin)
        ax.grid(axis="x", alpha=0.3)
    axes[0].axvspan(*window, color="#ffe680", alpha=0.5, zorder=0)  # where the zoom is
    raw = tl.raw
    b, h, n = raw["shape"]
    axes[0].set_title(f"{tl.step}: CTA 0 of batch {b}, {h} heads, N = {n} on {raw['gpu']} ({tl.work_tiles} work tile(s), "
                      f"{tl.span_us:.1f} us); time = clock64 at the {summary['clock_mhz']:.0f} MHz fitted to %globaltimer "
                      f"(step {tl.globaltimer_step_ns:.0f} ns)", fontsize=9)
    rescale = f", rescale {summary['rescale_mean_us']:.2f}" if summary["rescale_mean_us"] is not None else ""
    axes[1].set_title(f"zoom (shaded above): K/V tiles {zoom[0]}-{zoom[1]} of the first work tile (numbers: each softmax's tile). "
                      f"At least one consumer has a GEMM in flight {100 * summary['gemm_in_flight_share']:.0f}% of the run, "
                      f"{100 * summary['gemm_in_flight_share_zoom']:.0f}% here; mean us: GEMM {summary['gemm_mean_us']:.2f}, "
                      f"softmax {summary['softmax_mean_us']:.2f}{rescale}", fontsize=9)
    axes[1].set_xlabel("us since CTA 0's first event (a GEMM is in flight from its commit to the wait_group after which it is "
                       "complete: an upper bound)")
    handles = [Patch(color=c, label=label) for kind, (c, label) in STYLE.items()
               if any(x.kind == kind for w in lanes for x in tl.bars[w])]
    handles += [Patch(color=c, label=f"TMA {k} issued") for k, c in TICK_COLORS.items()
                if any(kk == k for w in lanes for kk, *_ in tl.ticks.get(w, []))]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    if path:
        fig.savefig(path)
    plt.close(fig)
    return fig


def report_step(raw: dict, zoom: tuple[int, int], out: Path) -> dict:
    """Analyse one step's raw events, draw its PNG into `out`; returns its summary."""
    tl = analyse(raw)
    window = zoom_window(tl, *zoom)
    summary = summarize(tl, window)
    draw(tl, zoom, window, summary, out / f"{tl.step}.png")
    if tl.fit_residual_ns > 2 * tl.globaltimer_step_ns + 1000:
        print(f"{tl.step}: warning: clock64 strays up to {tl.fit_residual_ns:.0f} ns from a straight line through "
              "%globaltimer (did the SM clock change during the run?)", flush=True)
    return summary


def table(summaries: dict[str, dict]) -> str:
    def us(x):
        return "-" if x is None else f"{x:.2f}"
    lines = ["step   | GEMM in flight (run / zoom) | GEMM us | softmax us | rescale us | waiting: data / turn | "
             "us per work tile: CTA 0 traced / untraced"]
    for step, s in sorted(summaries.items()):
        lines.append(f"{step} | {100 * s['gemm_in_flight_share']:5.1f}% / {100 * s['gemm_in_flight_share_zoom']:5.1f}%"
                     f"             | {us(s['gemm_mean_us']):>7} | {us(s['softmax_mean_us']):>10} | {us(s['rescale_mean_us']):>10} | "
                     f"{100 * s['full_wait_share']:5.1f}% / {100 * s['turn_wait_share']:5.1f}%        | "
                     f"{s['us_per_work_tile_traced']:.1f} / {s['us_per_work_tile_untraced']:.1f}")
    return "\n".join(lines)


# ---- the command ----

def shape_arg(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected three positive numbers batch,heads,seqlen, not {text!r}")
    return shape


def zoom_arg(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or int(m[1]) > int(m[2]):
        raise argparse.ArgumentTypeError(f"expected K/V tiles as LO-HI with LO <= HI, such as 8-12, not {text!r}")
    return int(m[1]), int(m[2])


def run_recorder(step: str, shape, raw_path: Path, timeout: float) -> str | None:
    """record() in a process of its own (a hung kernel blocks its process for good: only killing it frees the GPU).
    Returns None, or why it failed."""
    cmd = [sys.executable, "-m", "verify.trace", "--record", step, "--shape", ",".join(map(str, shape)), "--raw", str(raw_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"timed out after {timeout:g} s (a hung kernel?)"
    if proc.returncode != 0:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit code {proc.returncode}"
    return None


def main(argv=None) -> int:
    ap = steps_mod.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=steps_mod.steps_arg, help="e.g. 10-14, step12 (default: every step with trace points)")
    ap.add_argument("--shape", type=shape_arg, default=(1, 16, 4096), help="batch,heads,seqlen (default: 1,16,4096)")
    ap.add_argument("--zoom", type=zoom_arg, default=(8, 12), help="K/V tiles LO-HI to zoom on (default: 8-12)")
    ap.add_argument("--out", type=Path, metavar="DIR", help="where to write (default: results/<gpu>/timeline, or the --replay DIR)")
    ap.add_argument("--timeout", type=float, default=180, metavar="SECONDS", help="time limit for one step's run (default: %(default)s)")
    ap.add_argument("--replay", type=Path, metavar="DIR", help="no GPU: analyse and draw the stepNN.json files in DIR again")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel nvcc builds")
    ap.add_argument("--record", metavar="STEP", help=argparse.SUPPRESS)  # internal: the recording process
    ap.add_argument("--raw", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.record:
        try:
            record(args.record, args.shape, args.raw)
        except Exception as e:  # one line for the parent to show
            print(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}", flush=True)
            return 1
        return 0
    if args.timeout <= 0:
        ap.error(f"argument --timeout: must be positive, not {args.timeout:g}")
    try:
        traced = traced_steps()
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    if args.steps:
        untraced = [s for s in args.steps if s not in traced]
        if untraced:
            ap.error(f"argument --steps: {', '.join(untraced)} has no trace points (those that do: {', '.join(traced) or 'none'})")
    steps = args.steps or traced

    if args.replay:
        if not args.replay.is_dir():
            ap.error(f"argument --replay: {args.replay} is not a folder")
        found = sorted(p.stem for p in args.replay.glob("step[0-9][0-9].json"))
        steps = [s for s in steps if s in found] if not args.steps else steps
        missing = [s for s in steps if s not in found]
        if missing or not steps:
            ap.error(f"argument --replay: no {', '.join(f'{s}.json' for s in missing) or 'stepNN.json'} in {args.replay}")
        out = args.out or args.replay
    else:
        if why := steps_mod.no_gpu_reason():
            raise SystemExit(f"{PROG}: error: {why}")
        if not steps:
            raise SystemExit(f"{PROG}: error: no step has trace points (TRACE_EVENT, TRACE_SPAN)")
        import torch
        gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower().replace("nvidia", "")).strip("-") or "gpu"
        out = args.out or ROOT / "results" / gpu / "timeline"
        print(f"building {', '.join(steps)} (normal and trace builds) with nvcc", flush=True)
        try:
            steps_mod.build(steps, jobs=args.jobs, log=lambda *_: None)  # the untraced timing uses the normal build
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                list(pool.map(build, steps))
        except RuntimeError as e:
            print(e, flush=True)
            print(f"{PROG}: error: a build failed (nvcc's output above)", flush=True)
            return 1
    out.mkdir(parents=True, exist_ok=True)

    summaries, failed = {}, []
    for step in steps:
        raw_path = (args.replay or out) / f"{step}.json"
        if not args.replay:
            why = run_recorder(step, args.shape, raw_path, args.timeout)
            if why:
                print(f"{step}: FAILED ({why})", flush=True)
                failed.append(step)
                continue
        try:
            summaries[step] = report_step(json.loads(raw_path.read_text()), args.zoom, out)
        except (TraceError, KeyError, json.JSONDecodeError) as e:
            print(f"{step}: FAILED ({type(e).__name__}: {e})", flush=True)
            failed.append(step)
            continue
        print(f"{step}: wrote {out / (step + '.png')}", flush=True)
    if summaries:
        summary_path = out / "summary.json"
        merged = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        merged.update(summaries)
        summary_path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(table(summaries))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
