"""The measured timelines (common/trace.cuh, python -m verify.trace).

CPU, for each step with trace points (TRACE_EVENT, TRACE_SPAN): every point is a one-line statement and sits where the kernel
commits, waits for and hands over its GEMMs; tracing costs nothing when off (the normal build's SASS is the
SASS of the source without the trace lines, and it exports no trace function); the trace build compiles
without spills and without ptxas changing how the wgmma run. CPU, without a step: the analysis, the summary
and the drawing on a made-up (synthetic) event list, and that the analysis rejects broken lists (dropped,
out of order, unpaired ...); the command's errors. GPU: each trace build recorded once and checked.
"""
from __future__ import annotations

import copy
import ctypes
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from verify import steps as steps_mod
from verify import trace
from verify.tests.conftest import has_cuda_gpu, needs_gpu, selected_steps
from verify.tests.test_sass import find_cuobjdump, parse_sass, run_cuobjdump

build_step = steps_mod.build_step


def pytest_generate_tests(metafunc):
    if "traced_step" in metafunc.fixturenames:
        steps = trace.traced_steps(selected_steps())
        metafunc.parametrize("traced_step", steps, ids=steps)


@pytest.fixture(scope="session")
def trace_built():
    """The trace builds of the selected steps that have trace points (nvcc; cached by content in build/trace)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor() as pool:
        return dict(zip(trace.traced_steps(selected_steps()), pool.map(trace.build, trace.traced_steps(selected_steps()))))


@pytest.fixture(scope="session")
def cuobjdump() -> str:
    tool = find_cuobjdump()
    if tool is None:
        pytest.fail("cuobjdump not found (see verify/tests/test_sass.py): `pip install nvidia-cuda-cuobjdump`", pytrace=False)
    return tool


def kernel_cu(step: str) -> Path:
    return trace.step_dirs()[step] / "kernel.cu"


# ---- the trace points in the source ----

def code_of(source: str) -> str:
    return "\n".join(line.split("//", 1)[0] for line in source.splitlines())


def point_problems(source: str) -> list[str]:
    """Where a kernel's trace points disagree with its code: a GEMM commit, wait or turn without its event, or a
    span opened and not closed in the source."""
    # The forward's kernel is the one traced: the backward's wgmma (from step28) have no trace points yet.
    source = source.split("// ==== The backward", 1)[0]
    points = Counter(trace.points_in(source))
    code = code_of(source)
    expected = {"GEMM_ISSUED": code.count("wgmma_commit_group();"), "GEMM_WAITED_ALL": code.count("wgmma_wait_group<0>();"),
                "GEMM_WAITED_ALL_BUT_1": code.count("wgmma_wait_group<1>();"),
                # ping-pong's turn: a named barrier of both consumers' threads (one warpgroup's own is another barrier,
                # and so is any epilogue barrier)
                "TURN_WAIT_BEGIN": sum(1 for b, n in re.findall(r"named_barrier_sync\(([^,]+),\s*([^)]+)\)", code)
                                       if n.strip() not in ("WARPGROUP_THREADS", "128") and "EPILOGUE" not in b),
                # (the template arguments: the rows, and from step41 on the head dim: <BLOCK_M, D>)
                "TMA_K": len(re.findall(r"(?:load_tile_tma|load_kv_tile)<[\w, ]+>\(smem\.K\b", code)),
                "TMA_V": len(re.findall(r"(?:load_tile_tma|load_kv_tile)<[\w, ]+>\(smem\.V\b", code)),
                "TMA_Q": len(re.findall(r"load_tile_tma<[\w, ]+>\(smem\.Q\b", code))}
    problems = [f"{n} TRACE_{name} for {want} in the code" for name, want in expected.items() if (n := points[name]) != want]
    for span in trace.SPANS:
        if points[f"{span}_BEGIN"] != points[f"{span}_END"]:
            problems.append(f"{points[span + '_BEGIN']} TRACE_{span}_BEGIN but {points[span + '_END']} TRACE_{span}_END")
    for needed in ("SOFTMAX_BEGIN", "FULL_WAIT_BEGIN", "EMPTY_WAIT_BEGIN", "EPILOGUE_BEGIN"):
        if not points[needed]:
            problems.append(f"no TRACE_{needed}")
    if '#include "trace.cuh"' not in source:
        problems.append('no #include "trace.cuh"')
    return problems


def test_trace_points_sit_at_every_gemm_and_wait(traced_step):
    source = kernel_cu(traced_step).read_text()
    trace.trace_points(kernel_cu(traced_step))  # raises unless each is a one-line statement of a known event
    assert not point_problems(source), f"{traced_step}: " + "; ".join(point_problems(source))


def test_trace_point_check_fails_on_a_missing_point(traced_step):
    lines = kernel_cu(traced_step).read_text().splitlines()
    for name in ("GEMM_ISSUED", "GEMM_WAITED_ALL"):
        first = next(i for i, ln in enumerate(lines) if f"TRACE_{name}," in ln)
        assert point_problems("\n".join(lines[:first] + lines[first + 1:])), f"removing a TRACE_{name} went unnoticed"
    without_softmax = [ln for ln in lines if "TRACE_SOFTMAX_" not in ln]
    assert "no TRACE_SOFTMAX_BEGIN" in point_problems("\n".join(without_softmax))


def test_spans_and_pairs_of_events():
    """TRACE_SPAN(TRACE_X_BEGIN, a) stands for X_BEGIN and X_END (common/trace.cuh records the end where the scope
    closes); it takes only a *_BEGIN whose next enum value is its *_END. Explicit BEGIN/END events must pair up."""
    assert trace.points_in("    TRACE_SPAN(TRACE_SOFTMAX_BEGIN, j);\n") == ["SOFTMAX_BEGIN", "SOFTMAX_END"]
    assert trace.points_in("  TRACE_EVENT(TRACE_SOFTMAX_BEGIN, j);\n  TRACE_EVENT(TRACE_SOFTMAX_END, j);\n") == [
        "SOFTMAX_BEGIN", "SOFTMAX_END"]
    for wrong in ("TRACE_SOFTMAX_END", "TRACE_GEMM_ISSUED"):
        with pytest.raises(ValueError, match="TRACE_SPAN takes a TRACE_X_BEGIN"):
            trace.points_in(f"    TRACE_SPAN({wrong}, j);\n")
    assert "1 TRACE_SOFTMAX_BEGIN but 0 TRACE_SOFTMAX_END" in point_problems("  TRACE_EVENT(TRACE_SOFTMAX_BEGIN, j);\n")


def test_trace_point_must_be_a_line_of_its_own(tmp_path):
    cu = tmp_path / "kernel.cu"
    cu.write_text("    if (x) TRACE_EVENT(TRACE_SOFTMAX_BEGIN, 0);\n")
    with pytest.raises(ValueError, match="one-line statement"):
        trace.trace_points(cu)
    cu.write_text("    TRACE_EVENT(TRACE_NO_SUCH_EVENT, 0);\n")
    with pytest.raises(ValueError, match="not in common/trace.cuh"):
        trace.trace_points(cu)
    cu.write_text("    for (;;) { TRACE_SPAN(TRACE_SOFTMAX_BEGIN, 0); }\n")
    with pytest.raises(ValueError, match="one-line statement"):
        trace.trace_points(cu)


def test_event_enum_is_read_from_the_header(tmp_path):
    names = trace.event_names()
    assert trace.KNOWN <= set(names.values()) and len(set(names)) == len(names)
    header = tmp_path / "trace.cuh"
    header.write_text(re.sub(r"\n\s*TRACE_SOFTMAX_END = \d+,", "", trace.HEADER.read_text()))
    with pytest.raises(RuntimeError, match="SOFTMAX_END"):
        trace.event_names(header)


# ---- zero cost when off; the trace build ----

def strip_trace(source: str) -> str:
    """The source without its trace lines (blank lines in their place)."""
    return "\n".join("" if trace.TRACE_LINE.fullmatch(ln) or ln.strip() == '#include "trace.cuh"' else ln
                     for ln in source.split("\n"))


def sass(tool: str, binary: Path) -> list[tuple[str, str, str]]:
    proc = run_cuobjdump(tool, str(binary))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The anonymous namespace's mangled name hashes the source's path: drop the hash.
    out = [(re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__", i.function), i.address, i.text) for i in parse_sass(proc.stdout)]
    assert out, f"no SASS read from {binary}"
    return out


def exports_trace(so: Path) -> bool:
    return hasattr(ctypes.CDLL(str(so)), "flashladder_trace_read_warp")


UNTRACED = steps_mod.ROOT / "build" / "trace-off"  # each traced step's source without its trace lines (src/), and its build


def build_untraced(step: str) -> Path:
    """The step's source without its trace lines, built as the normal build is (build_step.compile_step, cached by
    content like every build: a source whose trace lines alone changed is not compiled again). Returns its library."""
    stripped = UNTRACED / "src" / step  # a step folder holding the source without its trace lines
    (stripped / "pkg").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kernel_cu(step).parent / "pkg" / "__init__.py", stripped / "pkg" / "__init__.py")
    text = strip_trace(kernel_cu(step).read_text())
    assert "TRACE_EVENT" not in text and "TRACE_SPAN" not in text, f"{step}: a trace line left after stripping"
    if not (stripped / "kernel.cu").is_file() or (stripped / "kernel.cu").read_text() != text:
        (stripped / "kernel.cu").write_text(text)
    build_step.compile_step(stripped, UNTRACED / step)  # the normal build's command, on the stripped source
    return UNTRACED / step / "_kernel.so"


@pytest.fixture(scope="session")
def untraced_built():
    """build_untraced of the selected steps that have trace points, side by side (nvcc: a minute each)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor() as pool:
        return dict(zip(trace.traced_steps(selected_steps()), pool.map(build_untraced, trace.traced_steps(selected_steps()))))


def test_tracing_costs_nothing_when_off(traced_step, built, trace_built, untraced_built, cuobjdump):
    """The normal build's machine code is that of the source without the trace lines, instruction for instruction,
    and it exports no trace function. The same comparison tells the trace build apart (so it can fail)."""
    without = sass(cuobjdump, untraced_built[traced_step])
    normal_so = steps_mod.DEV / "flashladder" / traced_step / "_kernel.so"
    normal = sass(cuobjdump, normal_so)
    diff = next((f"{a} vs {b}" for a, b in zip(normal, without) if a != b), f"{len(normal)} vs {len(without)} instructions")
    assert normal == without, f"{traced_step}: the trace lines change the normal build's SASS: {diff}"
    assert not exports_trace(normal_so), f"{traced_step}: the normal build exports flashladder_trace_read_warp"
    traced_so = trace_built[traced_step] / "_kernel.so"
    assert sass(cuobjdump, traced_so) != without and exports_trace(traced_so), f"{traced_step}: the trace build traces nothing"


def test_extra_flags_are_in_the_fingerprint(tmp_path):
    """verify.trace builds through build_step.compile_step with -DFLASHLADDER_TRACE added: the flag is part of the
    fingerprint, so a build with it is never taken for the build without it, in either direction (step01: any
    step's build shows it, and step01's is the quickest)."""
    step_dir, out = build_step.find_steps()[0], tmp_path / "pkg"
    assert build_step.compile_step(step_dir, out) is True
    assert build_step.compile_step(step_dir, out) is False, "an unchanged build was not cached"
    assert build_step.compile_step(step_dir, out, extra_nvcc_flags=trace.TRACE_FLAGS) is True, "the flag went unnoticed"
    assert build_step.compile_step(step_dir, out, extra_nvcc_flags=trace.TRACE_FLAGS) is False
    assert build_step.compile_step(step_dir, out) is True, "a build with the flag was taken for one without"
    with pytest.raises(TypeError, match="sequence of flags"):
        build_step.compile_step(step_dir, out, extra_nvcc_flags="-DFLASHLADDER_TRACE")


def test_trace_build_compiles_without_spills(traced_step, built, trace_built):
    report = (trace_built[traced_step] / "_ptxas.txt").read_text()
    archs = build_step.parse_ptxas(report)
    assert archs and all(archs.values()), f"{traced_step}: no kernel in the trace build's ptxas report"
    for arch, kernels in archs.items():
        for kernel, res in kernels.items():
            assert res.get("spill_stores") == 0 and res.get("spill_loads") == 0, \
                f"{traced_step} trace build, {kernel} ({arch}): {res}"
    # Tracing must not change how the wgmma run (a fence injected, wgmma serialized): the picture would lie.
    normal = trace.wgmma_warnings((steps_mod.DEV / "flashladder" / traced_step / "_ptxas.txt").read_text())
    traced = trace.wgmma_warnings(report)
    assert len(traced) <= len(normal), f"{traced_step}: the trace build gets ptxas warnings the normal one lacks: {traced}"


def test_wgmma_warnings_are_recognized():
    report = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 2919 by compiler to allow use of registers "
              "in GMMA in function '_ZN_kernel'\n") + """\
ptxas info    : Compiling entry function '_ZN41_GLOBAL__N__e86c7e80_9_kernel_cu_6d475b9220attention_fwd_kernelE9FwdParams' for 'sm_90a'
ptxas info    : Function properties for _ZN41_GLOBAL__N__e86c7e80_9_kernel_cu_6d475b9220attention_fwd_kernelE9FwdParams
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1024 bytes smem
ptxas warning : Potential Performance Loss: wgmma.mma_async instructions are serialized due to the presence of Extern calls"""
    found = trace.wgmma_warnings(report)
    assert [w[:30] for w in found] == [report.splitlines()[0][:30], report.splitlines()[-1][:30]]


def test_decode_reads_the_layout_of_trace_cuh():
    """Words packed as common/trace.cuh writes them (word 2: argument << 32 | event << 16 | warp) come back as rows."""
    names = trace.event_names()
    ids = {v: k for k, v in names.items()}
    packed = lambda arg, event, warp: ((arg & 0xFFFFFFFF) << 32) | (event << 16) | warp
    events = [[111, 222, packed(7, ids["SOFTMAX_BEGIN"], 5), 9, 0], [112, 223, packed(-1, ids["TMA_Q"], 5), 9, 0],
              [113, 224, packed(3, 0, 5), 9, 0], [114, 225, packed(3, 999, 5), 9, 0]]
    rows = [dict(zip(trace.COLUMNS, r)) for r in trace.decode(5, events, names)]
    assert [(r["region"], r["warp"], r["event"], r["arg"], r["clock"], r["globaltimer"], r["smid"]) for r in rows] == [
        (5, 5, "SOFTMAX_BEGIN", 7, 111, 222, 9), (5, 5, "TMA_Q", -1, 112, 223, 9),
        (5, 5, "UNWRITTEN", 3, 113, 224, 9), (5, 5, "UNKNOWN_999", 3, 114, 225, 9)]
    header = trace.HEADER.read_text()  # the layout decode() assumes is the one the header documents and writes
    assert "word 2: argument << 32 | event << 16 | warp" in header
    assert "uint64_t(uint32_t(argument)) << 32 | uint64_t(event) << 16 | warp" in header
    assert "make_ulonglong2(clock, globaltimer)" in header and "make_ulonglong2(info, smid)" in header


# ---- the analysis, on a made-up event list ----

SYNTH_MHZ = 1500.0        # the made-up SM clock of the synthetic events
SYNTH_TIMER_STEP = 1024   # ns: the made-up %globaltimer update step


def synthetic_raw(tiles=32, work=2, period=3000, wait=150, gemm=1000, softmax=600, epilogue=800):
    """A MADE-UP ping-pong schedule, not a measurement: warp 0 produces, warps 4-7 and 8-11 are two consumer
    warpgroups whose tiles start half a period apart. Times in cycles of a SYNTH_MHZ clock, %globaltimer in
    SYNTH_TIMER_STEP ns steps. Returns (raw file as record() writes it, truth): truth holds, in us since the first
    event, every consumer GEMM interval and the starts and ends of each warpgroup's softmaxes by (work, tile)."""
    events: dict[int, list[tuple[int, str, int]]] = {w: [] for w in (0, *range(4, 12))}
    truth = {"gemm": [], "softmax": {}, "softmax_us": softmax / SYNTH_MHZ, "gemm_us": gemm / SYNTH_MHZ}
    start = 0
    for u in range(work):
        p = events[0]
        p += [(start, "EMPTY_WAIT_BEGIN", u), (start + 10, "EMPTY_WAIT_END", u), (start + 20, "TMA_Q", u)]
        for j in range(tiles):
            t = start + 30 + j * period // 4 if j < 2 else start + (j - 1) * period
            p += [(t, "EMPTY_WAIT_BEGIN", j), (t + 40, "EMPTY_WAIT_END", j), (t + 50, "TMA_K", j),
                  (t + 60, "EMPTY_WAIT_BEGIN", j), (t + 100, "EMPTY_WAIT_END", j), (t + 110, "TMA_V", j)]
        for c in range(2):
            base0 = start + 200 + c * period // 2
            seq = [(base0, "FULL_WAIT_BEGIN", u), (base0 + 20, "FULL_WAIT_END", u)]
            for j in range(tiles):
                b = base0 + 40 + j * period
                g0, g1 = b + 2 * wait, b + 2 * wait + gemm
                seq += [(b, "FULL_WAIT_BEGIN", j), (b + wait, "FULL_WAIT_END", j), (b + wait, "TURN_WAIT_BEGIN", j),
                        (g0 - 5, "TURN_WAIT_END", j), (g0, "GEMM_ISSUED", j), (g1, "GEMM_WAITED_ALL", j),
                        (g1, "SOFTMAX_BEGIN", j), (g1 + softmax, "SOFTMAX_END", j)]
                truth["gemm"].append((g0, g1))
                truth["softmax"][(c, u, j)] = (g1, g1 + softmax)
            end = base0 + 40 + tiles * period
            seq += [(end, "EPILOGUE_BEGIN", u), (end + epilogue, "EPILOGUE_END", u)]
            for w in range(4 + 4 * c, 8 + 4 * c):  # the 4 warps of the group, a few cycles apart
                events[w] += [(t + (w % 4), name, arg) for t, name, arg in seq]
        start = max(t for evs in events.values() for t, *_ in evs) + 100
    clock0, timer0 = 7_000_000_000, 1_700_000_000_000_000_000
    rows = []
    for w, evs in events.items():
        for t, name, arg in evs:
            ns = timer0 + t * 1e3 / SYNTH_MHZ
            rows.append([w, w, name, arg, clock0 + t, int(ns // SYNTH_TIMER_STEP * SYNTH_TIMER_STEP), 3])
    first = min(t for evs in events.values() for t, *_ in evs)
    us = lambda t: (t - first) / SYNTH_MHZ
    truth["gemm"] = [(us(a), us(b)) for a, b in truth["gemm"]]
    truth["softmax"] = {k: (us(a), us(b)) for k, (a, b) in truth["softmax"].items()}
    truth["span_us"] = us(max(t for evs in events.values() for t, *_ in evs))
    raw = {"format": trace.FORMAT, "step": "synthetic", "shape": [1, 16, tiles * 128], "gpu": "made-up GPU (synthetic events)",
           "sm_count": 132, "work_tiles": 512, "kv_tiles": tiles, "untraced_us": 1000.0, "events_per_warp": 1 << 14,
           "attempted": {str(w): len(evs) for w, evs in events.items()}, "columns": trace.COLUMNS, "events": rows}
    return raw, truth


def covered_share(intervals, t0, t1, samples=400_001) -> float:
    """Share of [t0, t1] inside at least one interval, by sampling (independent of trace._union_us's sweep)."""
    ts = np.linspace(t0, t1, samples)
    covered = np.zeros_like(ts, dtype=bool)
    for a, b in intervals:
        covered |= (ts >= a) & (ts <= b)
    return covered.mean()


@pytest.mark.parametrize("gemm", [1000, 2000], ids=["gemms_apart", "gemms_overlapping"])
def test_analysis_of_a_synthetic_trace(gemm):
    raw, truth = synthetic_raw(gemm=gemm, softmax=400)
    tl = trace.analyse(raw)
    assert list(tl.lanes) == [0, 4, 8] and tl.consumers == [4, 8] and tl.work_tiles == 2
    tol = 2 * SYNTH_TIMER_STEP / (truth["span_us"] * 1e3)  # the fit's error: ~ a timer step over the span
    assert abs(1e3 / tl.ns_per_cycle / SYNTH_MHZ - 1) < tol
    assert abs(tl.span_us / truth["span_us"] - 1) < tol
    window = trace.zoom_window(tl, 8, 12)
    want = (min(truth["softmax"][(c, 0, 8)][0] for c in range(2)), max(truth["softmax"][(c, 0, 12)][1] for c in range(2)))
    assert np.allclose(window, want, rtol=tol, atol=0.01)
    s = trace.summarize(tl, window)
    assert abs(s["gemm_mean_us"] / truth["gemm_us"] - 1) < tol and abs(s["softmax_mean_us"] / truth["softmax_us"] - 1) < tol
    assert s["rescale_mean_us"] is None and s["work_tiles_cta0"] == 2
    for key, (t0, t1) in (("gemm_in_flight_share", (0, truth["span_us"])), ("gemm_in_flight_share_zoom", want)):
        assert abs(s[key] - covered_share(truth["gemm"], t0, t1)) < 0.01, key
    assert s["us_per_work_tile_untraced"] == pytest.approx(raw["untraced_us"] * raw["sm_count"] / raw["work_tiles"])


def test_drawing_of_a_synthetic_trace(tmp_path):
    from matplotlib.colors import to_rgba
    raw, truth = synthetic_raw()
    tl = trace.analyse(raw)
    window = trace.zoom_window(tl, 8, 12)
    fig = trace.draw(tl, (8, 12), window, trace.summarize(tl, window), tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000
    gemm_color = to_rgba(trace.STYLE["gemm"][0])
    gemms = [b for w in tl.consumers for b in tl.bars[w] if b.kind == "gemm"]
    assert len(gemms) == len(truth["gemm"])
    for ax, (t0, t1) in zip(fig.axes, [(0, tl.span_us), window]):
        drawn = sum(1 for c in ax.collections if len(c.get_facecolor()) and tuple(c.get_facecolor()[0]) == gemm_color)
        # one bar per GEMM of the drawn consumer warps that reaches into the panel
        assert drawn == sum(1 for b in gemms if b.end >= t0 and b.start <= t1), ax.get_title()


def rows_of(raw, warp):
    return [i for i, r in enumerate(raw["events"]) if r[0] == warp]


def remove(raw, warp, event, which=0):
    """Drop the which-th `event` of `warp` (and keep the warp's count true to what is left)."""
    i = [i for i in rows_of(raw, warp) if raw["events"][i][2] == event][which]
    del raw["events"][i]
    raw["attempted"][str(warp)] -= 1


def swap_clocks(raw, warp):
    a, b = rows_of(raw, warp)[5:7]
    raw["events"][a][4], raw["events"][b][4] = raw["events"][b][4], raw["events"][a][4]


BROKEN = {  # how to break a trace -> what the error must say
    "dropped": (lambda r: r["attempted"].update({"4": r["events_per_warp"] + 3}), "dropped"),
    "count_differs": (lambda r: r["attempted"].update({"4": r["attempted"]["4"] + 1}), "events read"),
    "out_of_order": (lambda r: swap_clocks(r, 4), "out of order"),
    "two_sms": (lambda r: r["events"][-1].__setitem__(6, 4), "SMs"),
    "wrong_region": (lambda r: r["events"][rows_of(r, 4)[3]].__setitem__(1, 5), "region"),
    "unwritten_slot": (lambda r: r["events"][rows_of(r, 8)[2]].__setitem__(2, "UNWRITTEN"), "did not start from 0"),
    "end_without_begin": (lambda r: remove(r, 4, "SOFTMAX_BEGIN"), "without a SOFTMAX_BEGIN"),
    "begin_twice": (lambda r: remove(r, 4, "SOFTMAX_END"), "has not ended"),
    "never_ended": (lambda r: remove(r, 8, "EPILOGUE_END", -1), "never ended"),
    "wait_without_gemm": (lambda r: remove(r, 4, "GEMM_ISSUED"), "nothing for it to wait for"),
    "gemm_never_waited": (lambda r: remove(r, 4, "GEMM_WAITED_ALL", -1), "never waited for"),
    "timer_stuck": (lambda r: [row.__setitem__(5, 5) for row in r["events"]], "barely moved"),
    "clocks_disagree": (lambda r: [row.__setitem__(5, row[4] * 100) for row in r["events"]], "not a GPU's"),
    "no_producer": (lambda r: r.update(events=[e for e in r["events"] if e[0] != 0], attempted={
        w: n for w, n in r["attempted"].items() if w != "0"}), "expected a producer"),
    "wrong_format": (lambda r: r.update(format="something-else"), "not a flashladder-trace"),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_analysis_rejects_a_broken_trace(how):
    raw, _ = synthetic_raw(tiles=16)
    trace.analyse(copy.deepcopy(raw))  # the unbroken trace passes: the error below is the breakage's
    breakage, message = BROKEN[how]
    breakage(raw)
    with pytest.raises(trace.TraceError, match=re.escape(message)):
        trace.analyse(raw)


def test_zoom_outside_the_trace_is_refused():
    tl = trace.analyse(synthetic_raw(tiles=8)[0])
    with pytest.raises(trace.TraceError, match="K/V tiles 0-7"):
        trace.zoom_window(tl, 8, 12)


def test_intra_warpgroup_overlap_pairs_each_wait_with_its_groups():
    """Step12's pattern: [S j][P V j-1] committed, wait_group<1> completes S j, wait_group<0> P V j-1."""
    raw, _ = synthetic_raw(tiles=4, work=1)
    mine = []
    for e in (e for e in raw["events"] if e[0] == 4):
        mine.append(e)
        if e[2] == "GEMM_ISSUED" and e[3] > 0:  # blocks 1..: a second commit group (P V of the tile before)
            mine.append(list(e))
        if e[2] == "GEMM_WAITED_ALL" and e[3] > 0:  # now wait_group<1> (S done), and wait_group<0> under the softmax
            e[2] = "GEMM_WAITED_ALL_BUT_1"
            mine.append([4, 4, "GEMM_WAITED_ALL", e[3], e[4] + 300, e[5], 3])
    mine.sort(key=lambda e: e[4])  # stable: events at one clock keep their order
    raw["events"] = [e for e in raw["events"] if e[0] != 4] + mine
    raw["attempted"]["4"] = len(mine)
    tl = trace.analyse(raw)
    gemms = [b for b in tl.bars[4] if b.kind == "gemm"]
    assert len(gemms) == 1 + 2 * 3
    by_tile = Counter(b.arg for b in gemms)
    assert by_tile == {0: 1, 1: 2, 2: 2, 3: 2}
    for tile in (1, 2, 3):  # the first group of a block ends at wait_group<1>, the second later
        first, second = [b for b in gemms if b.arg == tile]
        assert first.start == second.start and first.end < second.end


# ---- the command ----

def run_cli(*args, cwd=steps_mod.ROOT):
    return subprocess.run([sys.executable, "-m", "verify.trace", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_replay_draws_from_raw_files(tmp_path):
    step = trace.traced_steps()[0]
    raw, _ = synthetic_raw()
    raw["step"] = step
    (tmp_path / f"{step}.json").write_text(json.dumps(raw))
    proc = run_cli("--replay", str(tmp_path), "--steps", step)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / f"{step}.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {step} and 0 < summary[step]["gemm_in_flight_share"] <= 1
    assert "GEMM in flight" in proc.stdout and step in proc.stdout


def test_cli_replay_reports_a_broken_trace(tmp_path):
    step = trace.traced_steps()[0]
    raw, _ = synthetic_raw()
    raw["step"] = step
    remove(raw, 4, "SOFTMAX_END")
    (tmp_path / f"{step}.json").write_text(json.dumps(raw))
    proc = run_cli("--replay", str(tmp_path), "--steps", step)
    assert proc.returncode == 1 and f"{step}: FAILED (TraceError" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / f"{step}.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--zoom", "12-8"], "LO <= HI"),
    (["--shape", "1,16"], "three positive numbers"),
    (["--timeout", "0"], "must be positive"),
    (["--replay", "/nonexistent-folder"], "is not a folder"),
])
def test_cli_usage_errors_are_one_line(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_refuses_a_step_without_trace_points():
    untraced = [s for s in steps_mod.all_steps() if s not in trace.traced_steps()]
    if not untraced:
        pytest.skip("every step has trace points")
    proc = run_cli("--steps", untraced[0])
    assert proc.returncode == 2 and "has no trace points" in proc.stderr, proc.stderr


@pytest.mark.skipif(has_cuda_gpu(), reason="a GPU is here: the command would run")
def test_cli_without_gpu_is_one_line_error():
    proc = run_cli()
    assert proc.returncode != 0 and proc.stderr.strip().startswith("python -m verify.trace: error:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- on the GPU ----

@needs_gpu
def test_trace_recorded_on_the_gpu(traced_step, built, trace_built, tmp_path):
    """One traced launch (1 x 16 x 2048: 16 K/V tiles per work tile, 256 work tiles, so a persistent CTA 0 runs
    several): the events pass the analysis and count what the kernel did."""
    raw_path = tmp_path / f"{traced_step}.json"
    why = trace.run_recorder(traced_step, (1, 16, 2048), raw_path, timeout=240)
    assert why is None, f"{traced_step}: {why}"
    raw = json.loads(raw_path.read_text())
    tl = trace.analyse(raw)
    kv, work = raw["kv_tiles"], tl.work_tiles
    assert 1 <= work <= raw["work_tiles"]
    producer = next(iter(tl.lanes))
    assert Counter(k for k, *_ in tl.ticks[producer]) == {"Q": work, "K": kv * work, "V": kv * work}
    for w in tl.consumers:
        kinds = Counter(b.kind for b in tl.bars[w])
        assert kinds["softmax"] == kv * work and kinds["epilogue"] == work and kinds["gemm"] >= kv * work, (w, kinds)
    window = trace.zoom_window(tl, 2, 4)
    summary = trace.summarize(tl, window)
    trace.draw(tl, (2, 4), window, summary, tmp_path / f"{traced_step}.png")
    assert 0 < summary["gemm_in_flight_share"] <= 1
    assert summary["us_per_work_tile_untraced"] > 0 and summary["us_per_work_tile_traced"] > 0

