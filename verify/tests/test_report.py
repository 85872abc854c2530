"""CPU: the report (verify/report.py) on synthetic runs, and on every results file committed under results/.

A synthetic run's cells come from the real timer (SteadyState on test_bench's simulated GPU): the report
reads the same fields a GPU run writes. Every figure in them is synthetic, none is a measurement.
"""
import json
from pathlib import Path

import pytest

from verify import bench, report
from verify.bench import Timing
from verify.tests.test_bench import BOOST_MHZ, FALL_S, FAST_S, READ_S, falls_then_holds, steady, timed

ROOT = Path(__file__).resolve().parents[2]
QUICK = Timing(warmup_s=0.2, settle_max_s=0.2, window_s=0.05, settle_s=2.5 * READ_S, burst_calls=10)  # 2+ readings a span
QUICK_FALL_S = QUICK.warmup_s / 2


def quick_fall(t):  # test_bench's clock, falling over QUICK_FALL_S instead of FALL_S
    return falls_then_holds(t * FALL_S / QUICK_FALL_S)


def quick_never_settles(t):
    return BOOST_MHZ - 4 * QUICK.settle_mhz / QUICK.settle_s * t


META = {"gpu": "Synthetic GPU", "driver": "0.0", "torch": "0.0", "torch_cuda": "0.0", "cudnn": 0, "nvcc": "0.0"}


def synthetic_run(seqlens, steps=("step01", "step02"), capped=(), without=(), clock=True, peers=()):
    """Every step and SDPA backend (and the peers asked for) at every N, each a little faster than the one before it."""
    impls = [s for s in (*steps, *bench.SDPA_BACKENDS, *peers) if s not in without]
    timings = {}
    for i, impl in enumerate(impls):
        timings[impl] = {}
        for n in seqlens:
            batch, heads, _ = bench.shape_of(n)
            mhz_at = quick_never_settles if (impl, n) in capped else quick_fall
            _, _, cell = timed(mhz_at, timing=QUICK, clock=clock, call_s=FAST_S / (i + 1) * n / seqlens[0])
            timings[impl][str(n)] = bench.with_tflops(cell | {"batch": batch, "heads": heads}, bench.flops(batch, heads, n))
    _, _, gemm = timed(steady, timing=QUICK)
    timings["cublas_gemm"] = {str(bench.GEMM_N): bench.with_tflops(gemm, 2 * bench.GEMM_N**3)}
    return {"path": "results/synthetic.json", "meta": META, "steps": list(steps), "seqlens": list(seqlens),
            "checks": {s: "passed" for s in steps}, "timings": timings, "unavailable": {}}


def label(n):
    return "video" if n == bench.VIDEO_SEQLEN else f"{n // 1024}K"


@pytest.mark.parametrize("seqlens", [[1024, 2048], [2048, 8192, 32768], bench.SEQLENS_OF_RECORD])
def test_labels_follow_the_seqlens_run(seqlens):
    run = synthetic_run(seqlens)
    console, markdown = report.console_table(run), report.markdown_table(run)
    headline = [n for n in report.HEADLINE if n in seqlens] or seqlens
    ratios = "/".join(label(n) for n in headline)
    header = console.splitlines()[0]
    for n in seqlens:
        assert f"N={label(n)}" in header and f"N={label(n)}" in markdown.splitlines()[0]
    assert f"×prev({ratios})" in header and f"×cuDNN({ratios})" in header, header
    assert f"× previous step ({ratios})" in markdown and f"× cuDNN ({ratios})" in markdown
    if 4096 not in seqlens:
        assert "4K/8K/16K" not in console + markdown


def test_note_says_how_it_was_timed_and_the_clock_range():
    seqlens = [1024, 4096]
    run = synthetic_run(seqlens, capped=[("step02", 4096)])
    note = report.markdown_table(run).splitlines()[-1]
    cells = [run["timings"][impl][str(n)] for impl in ["step01", "step02", *bench.SDPA_BACKENDS] for n in seqlens]
    lo, hi = min(c["sm_mhz_min"] for c in cells), max(c["sm_mhz_max"] for c in cells)
    fewest, most = min(c["window_calls"] for c in cells), max(c["window_calls"] for c in cells)
    assert note.startswith("Sustained TFLOP/s")
    assert f"{lo:.0f}–{hi:.0f} MHz" in note
    assert f"{fewest} calls" in note and f"to {most} calls per figure" in note
    assert f"window of ≥ {min(c['window_s'] for c in cells):.2f} s" in note
    assert f"1 of {len(cells)} stopped at the time cap" in note
    gemm = run["timings"]["cublas_gemm"][str(bench.GEMM_N)]["tflops"]
    assert f"timed the same way: {gemm:.0f} TFLOP/s" in note and run["path"] in note


def test_note_of_an_uncapped_run_does_not_mention_the_cap():
    note = report.markdown_table(synthetic_run([1024])).splitlines()[-1]
    assert "cap" not in note


def test_note_of_a_run_without_clock_readings():
    note = report.markdown_table(synthetic_run([1024], clock=False)).splitlines()[-1]
    assert "the SM clock was not read" in note and "SM clock not recorded" in note
    assert "stopped falling" not in note and "MHz" not in note


def test_burst_vs_sustained_lines():
    run = synthetic_run([4096, 16384])
    console = report.console_table(run)
    cell = run["timings"]["sdpa_cudnn"]["16384"]
    line = next(ln for ln in console.splitlines() if ln.startswith(bench.LABELS["sdpa_cudnn"]) and "->" in ln)
    assert f"{cell['burst_tflops']:.0f} -> {cell['tflops']:.0f} ({cell['tflops'] / cell['burst_tflops'] - 1:+.1%}" in line
    assert f"{cell['sm_mhz_median']:.0f} MHz" in line
    assert any(ln.startswith(bench.LABELS["cublas_gemm"]) for ln in console.splitlines())


def test_chart_has_a_linear_panel_of_ratios_to_cudnn(tmp_path):
    run = synthetic_run([1024, 4096])
    fig = report.chart(run, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top, bottom = fig.axes[:2]
    assert top.get_yscale() == "log" and bottom.get_yscale() == "linear"
    heights = sorted(round(b.get_height(), 9) for b in bottom.patches)
    ratios = sorted(round(v or 0, 9) for r in report.rows(run) for v in r["vs_cudnn"].values())
    assert heights == ratios
    fig = report.chart(synthetic_run([1024], without=["sdpa_cudnn"]), tmp_path / "no_cudnn.png")
    assert len(fig.axes) == 1, "no ratio panel without cuDNN figures"


RESULTS = sorted(p for p in (ROOT / "results").rglob("*.json")
                 if "timings" in json.loads(p.read_text()) and not report.backward_of(json.loads(p.read_text())))
BACKWARD_RESULTS = sorted(p for p in (ROOT / "results").rglob("*.json") if report.backward_of(json.loads(p.read_text())))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_results_file_renders(path, tmp_path):
    """python -m verify --report FILE must work for old files too (burst-only, no clock data)."""
    run = report.load(path)
    note = report.markdown_table(run).splitlines()[-1]
    report.console_table(run)
    report.chart(run, tmp_path / "chart.png")
    cells = [c for impl, cs in run["timings"].items() if impl != "cublas_gemm" for c in cs.values()]
    if not all("window_calls" in c for c in cells):
        assert "boost-clock bursts" in note, note


@pytest.mark.parametrize("path", BACKWARD_RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_backward_file_renders(path):
    """python -m verify.backward --report FILE: a row per implementation, each with a figure."""
    run = report.load(path)
    rows = report.backward_rows(run)
    assert rows and all(any(v for v in r["tflops"].values()) for r in rows)
    assert report.backward_markdown_table(run) and report.backward_console_table(run)


def test_there_are_committed_results_files():
    assert RESULTS, "no results file under results/: test_every_committed_results_file_renders tests nothing"


def test_fa3_column_is_each_row_over_fa3_at_every_shape():
    run = synthetic_run(bench.SEQLENS_OF_RECORD, peers=("fa3",))
    markdown = report.markdown_table(run)
    header = markdown.splitlines()[0]
    assert "× FA3 (" + "/".join(label(n) for n in bench.SEQLENS_OF_RECORD) + ")" in header
    step02 = next(ln for ln in markdown.splitlines() if ln.startswith("| step02 "))
    want = " / ".join(f"{report._tf(run, 'step02', n) / report._tf(run, 'fa3', n):.2f}" for n in bench.SEQLENS_OF_RECORD)
    assert step02.rstrip(" |").endswith(want)
    fa3_row = next(ln for ln in markdown.splitlines() if ln.startswith(f"| {bench.LABELS['fa3']} "))
    assert fa3_row.endswith("|  |")  # FA3 is not shown over itself
    assert "×FA3(" in report.console_table(run).splitlines()[0]
    assert "FA3" not in report.markdown_table(synthetic_run(bench.SEQLENS_OF_RECORD)).splitlines()[0]


def test_video_shape_has_its_own_batch_and_heads():
    assert bench.shape_of(bench.VIDEO_SEQLEN) == (1, bench.VIDEO_HEADS, bench.VIDEO_SEQLEN)
    assert bench.shape_of(4096) == (bench.TOTAL_TOKENS // 4096, bench.HEADS, 4096)
    assert "video: batch 1, 12 heads, N = 32760" in report.timing_note(synthetic_run(bench.SEQLENS_OF_RECORD))


def test_fa3_absent_is_said_not_raised():
    try:
        import fa3_fwd_interface  # noqa: F401
        pytest.skip("fa3-fwd is installed here")
    except ImportError:
        pass
    fn, why = bench.fa3_attention()
    assert fn is None and why.startswith("not installed")


# ---- the causal table (a step with info["causal"]: bench.run's causal rows) ----

REFUSED = "cuDNN does not support grouped-query attention; No available kernel. Aborting execution."  # synthetic


def with_causal(run, step="step15", fa3=True, refused=()):
    """The run with a causal table: its rows at the causal N of the run (every figure synthetic, from the simulated
    timer), `refused` cells (impl, N) not timed with REFUSED as torch's reason."""
    seqlens = bench.causal_seqlens(run["seqlens"])
    names = bench.causal_names(step)
    run.setdefault("not_timed", {})
    for table, impls in names.items():
        for i, impl in enumerate(impls):
            if impl.startswith("fa3_") and not fa3:
                run["unavailable"][impl] = "not installed (test)"
                continue
            run["timings"][impl] = {}
            for n in seqlens:
                if (impl, n) in refused:
                    run["not_timed"].setdefault(impl, {})[str(n)] = REFUSED
                    continue
                batch, heads, heads_kv, _ = bench.causal_shape_of(table, n)
                _, _, cell = timed(quick_fall, timing=QUICK, call_s=FAST_S / (2 + i) * n / seqlens[0])
                run["timings"][impl][str(n)] = bench.with_tflops(cell | {"batch": batch, "heads": heads, "heads_kv": heads_kv},
                                                                 bench.causal_flops(batch, heads, n))
    run["causal"] = bench.causal_method(step, seqlens)
    run["checks"][step] = "passed"
    return run


def as_loaded(run, tmp_path):
    """The run as --report reads it back from its results file (JSON: N keys as strings)."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    return report.load(path)


def test_the_causal_table_follows_the_dense_one(tmp_path):
    plain = synthetic_run(bench.SEQLENS_OF_RECORD, peers=("fa3",))
    dense = report.markdown_table(plain)
    run = as_loaded(with_causal(synthetic_run(bench.SEQLENS_OF_RECORD, peers=("fa3",))), tmp_path)
    markdown = report.markdown_table(run)
    assert markdown.startswith(dense.split("\n\n")[0].rsplit("\n", 1)[0])  # the dense rows as they were
    causal = markdown.split("\n\n")[-2:]
    lines = causal[0].splitlines()
    assert lines[0] == "| causal | N=4K | N=8K | N=16K | × cuDNN causal (4K/8K/16K) | × FA3 (4K/8K/16K) |"
    assert [ln.split(" | ")[0] for ln in lines[2:]] == [
        "| step15 causal, 16 heads", "| SDPA cuDNN causal, 16 heads", "| FA3 causal, 16 heads",
        "| step15 GQA, 32/8 heads", "| SDPA cuDNN GQA, 32/8 heads", "| FA3 GQA, 32/8 heads"]
    gqa = next(ln for ln in lines if ln.startswith("| step15 GQA"))
    tf = lambda impl, n: report._tf(run, impl, n)
    vs_cudnn = " / ".join(f"{tf('step15_gqa', n) / tf('sdpa_cudnn_gqa', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    vs_fa3 = " / ".join(f"{tf('step15_gqa', n) / tf('fa3_gqa', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    assert gqa.endswith(f"| {vs_cudnn} | {vs_fa3} |"), gqa
    assert " | ".join(f"{tf('step15_gqa', n):.0f}" for n in bench.CAUSAL_SEQLENS) in gqa
    cudnn = next(ln for ln in lines if ln.startswith("| SDPA cuDNN causal"))
    fa3 = next(ln for ln in lines if ln.startswith("| FA3 causal"))
    assert cudnn.split(" | ")[4] == "" and fa3.endswith("|  |")  # neither shown over itself
    note = causal[1]
    assert "half the dense FLOPs" in note and "Llama-3-8B's 32 query heads over 8 key/value heads" in note
    assert "16 heads" in note and "Not timed" not in note
    console = report.console_table(run).split("\n\n")[-1].splitlines()
    assert console[0].startswith("causal") and "×cuDNN(4K/8K/16K)" in console[0] and "×FA3(4K/8K/16K)" in console[0]
    assert len(console) == 2 + 6 and console[2].startswith("step15 causal, 16 heads")


def test_the_causal_cells_count_half_the_dense_flops(tmp_path):
    run = as_loaded(with_causal(synthetic_run([4096])), tmp_path)
    cell = report._cell(run, "step15_gqa", 4096)
    batch, heads, _, n = bench.causal_shape_of("gqa", 4096)
    assert cell["tflops"] == pytest.approx(2 * batch * heads * n * n * bench.HEAD_DIM / (cell["median_ms"] * 1e-3) / 1e12)
    assert report.causal_markdown_table(run).splitlines()[0].startswith("| causal | N=4K | × cuDNN causal (4K) |")


def test_a_refused_cell_says_why_in_the_causal_table_alone(tmp_path):
    refused = {("sdpa_cudnn_gqa", n) for n in bench.CAUSAL_SEQLENS}
    run = with_causal(synthetic_run(bench.SEQLENS_OF_RECORD), refused=refused)
    run["not_timed"]["step01"] = {str(bench.VIDEO_SEQLEN): "seqlen not a multiple of 128"}
    run = as_loaded(run, tmp_path)
    markdown = report.markdown_table(run)
    dense_note, causal_note = report.not_timed_note(run), report.causal_note(run)
    assert "step01 at N=video" in dense_note and "sdpa_cudnn_gqa" not in dense_note
    assert f"Not timed (-): sdpa_cudnn_gqa at N=4K/8K/16K: {REFUSED}" in causal_note and not causal_note.endswith("..")
    row = next(ln for ln in markdown.splitlines() if ln.startswith("| SDPA cuDNN GQA"))
    assert row == "| SDPA cuDNN GQA, 32/8 heads | - | - | - |  | - / - / - |"
    step = next(ln for ln in markdown.splitlines() if ln.startswith("| step15 GQA"))
    assert "| - / - / - | " in step and not step.endswith("| - / - / - |"), step  # × cuDNN: none; × FA3: there
    assert f"not timed: sdpa_cudnn_gqa N=4096: {REFUSED}" in report.console_table(run)


def test_without_fa3_the_causal_table_has_no_fa3_column_or_rows(tmp_path):
    run = as_loaded(with_causal(synthetic_run(bench.SEQLENS_OF_RECORD), fa3=False), tmp_path)
    table = report.causal_markdown_table(run)
    assert "FA3" not in table.splitlines()[0] and not any(ln.startswith("| FA3") for ln in table.splitlines())
    assert "×FA3" not in report.causal_console_table(run)


def test_a_run_without_a_causal_table_renders_as_before():
    run = synthetic_run(bench.SEQLENS_OF_RECORD)
    assert report.causal_rows(run) == [] and report.causal_markdown_table(run) == "" and report.causal_names(run) == []
    assert "| causal |" not in report.markdown_table(run) and "causal" not in report.console_table(run)


def test_only_steps_keeps_the_peers_and_drops_a_causal_table_whose_step_goes():
    """`python -m verify --report RUN --steps ...`: a table of the steps whose kernels the run timed, the peers kept;
    the causal table goes with its step."""
    run = report.load(ROOT / "results" / "h200" / "2026-12-03T05-38-21Z.json")
    kept = report.only_steps(run, [f"step{n:02d}" for n in range(1, 16)])
    table = report.markdown_table(kept)
    assert "| step15 " in table and "| step16 " not in table and "FlashAttention-3" in table and "causal" not in table
    assert "| step19 causal" in report.markdown_table(run)  # the whole run's table has them


# ---- the breadth tables (a step that takes fp16: bench.run's breadth rows) ----

def with_breadth(run, step="step40", fa3=True, tables=("fp16",)):
    """The run (with its causal table) and breadth tables: their rows at the causal N (every figure synthetic)."""
    seqlens = bench.causal_seqlens(run["seqlens"])
    for table, impls in bench.breadth_names(step, tables).items():
        d = bench.BREADTH_TABLES[table.removesuffix("_causal")]["head_dim"]
        for i, impl in enumerate(impls):
            if impl.startswith("fa3_") and not fa3:
                continue
            run["timings"][impl] = {}
            for n in seqlens:
                batch, heads, _ = bench.shape_of(n)
                _, _, cell = timed(quick_fall, timing=QUICK, call_s=FAST_S / (2 + i) * n / seqlens[0])
                work = (bench.causal_flops if table.endswith("_causal") else bench.flops)(batch, heads, n, d)
                run["timings"][impl][str(n)] = bench.with_tflops(cell | {"batch": batch, "heads": heads}, work)
    run["breadth"] = bench.breadth_method(bench.BreadthStep(step, None, tables), seqlens)
    run["checks"][step] = "passed"
    return run


def test_the_breadth_tables_follow_the_causal_one(tmp_path):
    run = synthetic_run(bench.SEQLENS_OF_RECORD, steps=("step39", "step40"), peers=("fa3",))
    run = as_loaded(with_breadth(with_causal(run, step="step40")), tmp_path)
    markdown = report.markdown_table(run)
    breadth = markdown.split("\n\n")[-2:]
    lines = breadth[0].splitlines()
    assert lines[0] == ("| breadth | N=4K | N=8K | N=16K | × bf16 d128 (4K/8K/16K) | × cuDNN (4K/8K/16K) | "
                        "× FA3 (4K/8K/16K) |")
    assert [ln.split(" | ")[0] for ln in lines[2:]] == [
        "| step40 fp16", "| SDPA cuDNN fp16", "| FlashAttention-3 fp16",
        "| step40 fp16 causal", "| SDPA cuDNN fp16 causal", "| FlashAttention-3 fp16 causal"]
    tf = lambda impl, n: report._tf(run, impl, n)  # noqa: E731
    row = next(ln for ln in lines if ln.startswith("| step40 fp16 causal"))
    vs_bf16 = " / ".join(f"{tf('step40_fp16_causal', n) / tf('step40_causal', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    vs_fa3 = " / ".join(f"{tf('step40_fp16_causal', n) / tf('fa3_fp16_causal', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    cells = " | ".join(f"{tf('step40_fp16_causal', n):.0f}" for n in bench.CAUSAL_SEQLENS)
    assert row.startswith(f"| step40 fp16 causal | {cells} | {vs_bf16} |"), row
    assert row.endswith(f"| {vs_fa3} |"), row
    cudnn = next(ln for ln in lines if ln.startswith("| SDPA cuDNN fp16 |"))
    vs_bf16 = " / ".join(f"{tf('sdpa_cudnn_fp16', n) / tf('sdpa_cudnn', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    assert f"| {vs_bf16} |  |" in cudnn, cudnn  # over its own bf16; not over itself
    assert "× bf16 d128: over the same implementation in bf16 at head dim 128" in breadth[1] and "Not timed" not in breadth[1]
    assert "(fp16: float16, d = 128)" in breadth[1], breadth[1]
    console = report.console_table(run).split("\n\n")[-1].splitlines()
    assert console[0].startswith("breadth") and "×bf16d128(4K/8K/16K)" in console[0] and len(console) == 2 + 6
    kept = report.only_steps(run, ["step39"])
    assert "| breadth |" not in report.markdown_table(kept) and not report.breadth_names(kept)


def test_the_head_dim_64_rows_are_read_against_the_step_s_head_dim_128(tmp_path):
    """A step that takes head dim 64 (step41) gets rows of its own in the breadth tables, each over the same
    implementation's bf16 at 128 in the same shapes, its TFLOP/s counted at d = 64."""
    run = synthetic_run(bench.SEQLENS_OF_RECORD, steps=("step40", "step41"), peers=("fa3",))
    run = as_loaded(with_breadth(with_causal(run, step="step41"), step="step41", tables=("fp16", "hdim64")), tmp_path)
    lines = report.markdown_table(run).split("\n\n")[-2].splitlines()
    assert [ln.split(" | ")[0] for ln in lines[2:]][6:] == [
        "| step41 head dim 64", "| SDPA cuDNN head dim 64", "| FlashAttention-3 head dim 64",
        "| step41 head dim 64 causal", "| SDPA cuDNN head dim 64 causal", "| FlashAttention-3 head dim 64 causal"]
    tf = lambda impl, n: report._tf(run, impl, n)  # noqa: E731
    row = next(ln for ln in lines if ln.startswith("| step41 head dim 64 |"))
    vs_128 = " / ".join(f"{tf('step41_hdim64', n) / tf('step41', n):.2f}" for n in bench.CAUSAL_SEQLENS)
    assert f"| {vs_128} |" in row, row
    cell = run["timings"]["step41_hdim64"]["4096"]
    assert cell["tflops"] == pytest.approx(bench.flops(cell["batch"], cell["heads"], 4096, 64) / cell["median_ms"] / 1e9)
    assert "head dim 64: bfloat16, d = 64" in report.markdown_table(run).split("\n\n")[-1]


def test_a_run_without_breadth_tables_renders_as_before():
    run = synthetic_run(bench.SEQLENS_OF_RECORD)
    assert report.breadth_rows(run) == [] and report.breadth_markdown_table(run) == "" and report.breadth_names(run) == []
    assert "| breadth |" not in report.markdown_table(run) and "fp16" not in report.console_table(run)
