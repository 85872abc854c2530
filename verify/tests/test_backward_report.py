"""CPU: the backward's table (verify/report.py) and python -m verify.backward's command line, no GPU work.

The README's backward table is what the results file it names gives (regenerated here and compared); the ratios are
the file's figures divided; a bad command line is one line and exit code 2.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verify import backward_timing, report

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def readme_backward() -> str:
    text = README.read_text()
    return text[text.index(report.BACKWARD_BEGIN) + len(report.BACKWARD_BEGIN):text.index(report.BACKWARD_END)].strip()


def cited_file() -> Path:
    m = re.search(r"Source: `(results/[^`]+\.json)`", readme_backward())
    assert m, "the README's backward table names no results file"
    return ROOT / m.group(1)


def test_the_readme_backward_table_is_what_its_results_file_gives():
    run = report.load(cited_file())
    run["path"] = str(cited_file().relative_to(ROOT))
    assert readme_backward() == report.backward_markdown_table(run), \
        "README.md's backward table is stale: python -m verify.backward --report " + run["path"]


def test_the_ratios_are_the_files_figures_divided():
    run = report.load(cited_file())
    b = report.backward_of(run)
    rows = {r["impl"]: r for r in report.backward_rows(run)}
    step = f"{b['step']}_bwd"
    assert step in rows and "sdpa_cudnn_bwd" in rows
    for n in b["seqlens"]:
        mine, cudnn = (b["timings"][name][str(n)]["tflops"] for name in (step, "sdpa_cudnn_bwd"))
        assert rows[step]["vs_cudnn"][n] == pytest.approx(mine / cudnn)
    assert rows["sdpa_cudnn_bwd"]["vs_cudnn"] == {}


def test_a_run_without_a_backward_has_no_table():
    assert report.backward_markdown_table({"timings": {"step22": {}}}) == ""
    assert report.backward_of({"timings": {"step22": {"4096": {"tflops": 1.0}}}}) is None


def test_the_steps_with_a_backward_are_found_by_their_export():
    found = backward_timing.steps_with_backward()
    assert found and all("flashladder_bwd(" in (ROOT / "steps" / s / "kernel.cu").read_text() for s in found)
    assert "step22" not in found


def test_the_backward_table_takes_the_seqlens_of_the_run():
    assert backward_timing.backward_seqlens([1024, 4096, 16384, 32760]) == [4096, 16384]
    assert backward_timing.backward_seqlens([1024]) == []


@pytest.mark.parametrize("argv, says", [
    (["--report", "no/such/file.json"], "cannot read"),
    (["--steps", "1"], "no selected step has a backward"),
    (["--seqlens", "0"], "sequence lengths must be positive"),
])
def test_a_bad_command_line_is_one_line(argv, says):
    res = subprocess.run([sys.executable, "-m", "verify.backward", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_flashattention_4_is_optional_and_called_in_its_own_layout(monkeypatch):
    """Without flash-attn-4 the table goes on without it, saying why; with it (a stand-in here), FA4 gets
    [batch, seqlen, heads, d] views and its O comes back in torch's layout."""
    import types

    import torch
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # an import of it fails, as where it is not installed
    fa4, why = backward_timing.fa4_attention()
    assert fa4 is None and why.startswith("FlashAttention-4 not importable")
    seen = {}

    def flash_attn_func(q, k, v, causal=False):
        seen.update(shape=tuple(q.shape), causal=causal)
        return q * 2, None
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    fa4, why = backward_timing.fa4_attention()
    q = torch.randn(2, 4, 16, 8)
    out = backward_timing.implementations({}, True, fa4)["fa4_bwd_causal"](q, q, q)
    assert why is None and seen == {"shape": (2, 16, 4, 8), "causal": True} and torch.equal(out, q * 2)


def test_the_grouped_heads_pass_is_named_and_labelled_as_the_forwards():
    """The third pass: causal with Llama-3-8B's 32 query heads over 8 key/value heads, rows ending in _gqa, SDPA given
    enable_gqa=True; the table labels them and its note says what they are."""
    suffix, causal, heads, heads_kv, dtype, d = backward_timing.PASSES[2]
    assert (suffix, causal, heads, heads_kv, dtype, d) == ("_gqa", True, 32, 8, "bfloat16", 128)
    assert set(backward_timing.implementations({}, True, None, "_gqa")) == {"sdpa_cudnn_bwd_gqa", "sdpa_flash_bwd_gqa"}
    cell = lambda tf: {"4096": {"tflops": tf}}  # noqa: E731
    run = {"backward": {"step": "step26", "seqlens": [4096], "timings": {
        "step26_bwd_gqa": cell(100.0), "sdpa_cudnn_bwd_gqa": cell(400.0)}}}
    rows = {r["impl"]: r for r in report.backward_rows(run)}
    assert rows["step26_bwd_gqa"]["label"] == "step26 GQA, 32/8 heads"
    assert rows["step26_bwd_gqa"]["vs_cudnn"] == {4096: 0.25}
    assert "32 query heads over 8 key/value heads" in report.backward_note(run)


def test_the_fp16_passes_are_named_and_labelled_as_the_forwards():
    """The fourth and fifth passes: the dense and causal calls in fp16, rows ending in _fp16 and _fp16_causal (as the
    forward's breadth tables name theirs), for the steps that take fp16 alone; the table labels them, the note says so."""
    assert [p[0] for p in backward_timing.PASSES[3:5]] == ["_fp16", "_fp16_causal"]
    assert [(p[1], p[4], p[5]) for p in backward_timing.PASSES[3:5]] == [(False, "float16", 128), (True, "float16", 128)]
    cell = lambda tf: {"4096": {"tflops": tf}}  # noqa: E731
    run = {"backward": {"step": "step40", "seqlens": [4096], "timings": {
        "step40_bwd": cell(500.0), "step40_bwd_fp16": cell(490.0), "sdpa_cudnn_bwd_fp16": cell(245.0),
        "step40_bwd_fp16_causal": cell(450.0), "sdpa_cudnn_bwd_fp16_causal": cell(300.0)}}}
    rows = {r["impl"]: r for r in report.backward_rows(run)}
    assert rows["step40_bwd_fp16"]["label"] == "step40 fp16" and rows["step40_bwd_fp16"]["vs_cudnn"] == {4096: 2.0}
    assert rows["step40_bwd_fp16_causal"]["label"] == "step40 fp16 causal"
    assert rows["step40_bwd_fp16_causal"]["vs_cudnn"] == {4096: 1.5}
    assert rows["step40_bwd"]["vs_cudnn"] == {4096: None}  # no bf16 cuDNN row in this run: not the fp16 one
    assert "in fp16" in report.backward_note(run)


def test_the_head_dim_64_passes_are_named_and_labelled_as_the_forwards():
    """The sixth and seventh passes: the dense and causal calls at head dim 64 in bf16, rows ending in _hdim64 and
    _hdim64_causal (as the forward's breadth tables name theirs), for the steps whose backward takes 64 alone
    (info["backward_head_dims"]: step42 on); the table labels them, the note says so."""
    assert [(p[0], p[1], p[4], p[5]) for p in backward_timing.PASSES[5:]] == [
        ("_hdim64", False, "bfloat16", 64), ("_hdim64_causal", True, "bfloat16", 64)]
    cell = lambda tf: {"4096": {"tflops": tf}}  # noqa: E731
    run = {"backward": {"step": "step42", "seqlens": [4096], "timings": {
        "step42_bwd": cell(500.0), "step42_bwd_hdim64": cell(400.0), "sdpa_cudnn_bwd_hdim64": cell(200.0),
        "step42_bwd_hdim64_causal": cell(300.0), "sdpa_cudnn_bwd_hdim64_causal": cell(200.0)}}}
    rows = {r["impl"]: r for r in report.backward_rows(run)}
    assert rows["step42_bwd_hdim64"]["label"] == "step42 head dim 64" and rows["step42_bwd_hdim64"]["vs_cudnn"] == {4096: 2.0}
    assert rows["step42_bwd_hdim64_causal"]["label"] == "step42 head dim 64 causal"
    assert rows["step42_bwd_hdim64_causal"]["vs_cudnn"] == {4096: 1.5}
    assert "at d = 64" in report.backward_note(run)
