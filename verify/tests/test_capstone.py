"""CPU: python -m verify.capstone's parts (verify/capstone.py) on small models made in-process with random weights.

The configuration and shapes against diffusers' own modules; the bf16 cast against diffusers' from_pretrained; a tiny
WanTransformer3DModel whose every attention call goes through the drop-in, in eager and under torch.compile (a
stand-in op takes the routed calls on CPU: verify/tests/test_sdpa_router.py); the benchmark loop, its results record,
the README section and the chart; the sample-video path end to end (a tiny WanPipeline: prompt, denoising loop through
the drop-in, decode, mp4 and PNG written). diffusers and transformers are optional (requirements-capstone.txt): these
tests skip without them, except in CI (CI=true, as .ci/run's runs have it), where `nox -s tests` installs them.
"""
import contextlib
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from verify import capstone, models  # noqa: E402
from verify import steps as steps_mod  # noqa: E402
from verify.tests.test_sdpa_router import CPU_LIMITS, binding, stand_in_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def optional(name: str):
    """An optional dependency: skipped without it, but in CI, where its absence is a failure."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is optional here (pip install -r requirements-capstone.txt)")


@pytest.fixture(scope="module")
def diffusers():
    optional("transformers")
    return optional("diffusers")


def tiny_config(layers=2):
    """Wan2.1-T2V-1.3B's configuration, smaller everywhere but the head dim (128, what the step takes)."""
    return {**capstone.WAN_T2V_1_3B, "num_attention_heads": 2, "text_dim": 64, "freq_dim": 32, "ffn_dim": 64,
            "num_layers": layers}


def stand_in_step():
    """What the capstone needs of a step module, with the stand-in op behind its router: it routes CPU tensors."""
    return types.SimpleNamespace(
        info={"step": "stand_in"},
        sdpa=lambda strict=False: binding.SdpaRouter(stand_in_attention, CPU_LIMITS, strict, name="stand_in.sdpa"))


@pytest.fixture
def fresh_compile():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------- the model, its configuration and inputs

def test_the_configuration_is_one_diffusers_takes(diffusers):
    import inspect
    params = inspect.signature(diffusers.WanTransformer3DModel.__init__).parameters
    assert set(capstone.WAN_T2V_1_3B) <= set(params), set(capstone.WAN_T2V_1_3B) - set(params)
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**capstone.WAN_T2V_1_3B)
    assert model.config.num_attention_heads * model.config.attention_head_dim == 1536  # Wan2.1-T2V-1.3B's width
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(1.4, abs=0.1), "not a 1.3B-class model"


@pytest.mark.parametrize("tokens", sorted(capstone.SHAPES))
def test_the_shapes_of_record_give_their_token_counts_in_diffusers_model(diffusers, tokens):
    """The latents made for a shape, patchified by the model's own embedding, are that many tokens."""
    config = capstone.WAN_T2V_1_3B
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**{**config, "num_layers": 1}).to(torch.bfloat16)
    latents = models.make_inputs(config, capstone.SHAPES[tokens], "meta")["hidden_states"]
    assert model.patch_embedding(latents).flatten(2).shape[-1] == tokens == capstone.tokens_of(capstone.SHAPES[tokens])


def test_the_bf16_cast_is_diffusers_own(diffusers, tmp_path):
    """Every parameter's dtype as diffusers' from_pretrained(torch_dtype=torch.bfloat16) leaves it, float32 where the
    class keeps modules in float32."""
    model = capstone.build_transformer(tiny_config(), "cpu")
    model.save_pretrained(tmp_path)
    loaded = diffusers.WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    ours = {n: p.dtype for n, p in model.named_parameters()}
    assert ours == {n: p.dtype for n, p in loaded.named_parameters()}
    assert {torch.float32, torch.bfloat16} == set(ours.values())
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_every_attention_call_of_the_model_goes_through_the_drop_in(diffusers, fresh_compile):
    """A tiny Wan model, its attention calls taken by the stand-in op: all of them (a self- and a cross-attention per
    block), in eager and compiled whole with fullgraph=True, and the two agree."""
    config = tiny_config()
    model = capstone.build_transformer(config, "cpu")
    args = models.make_inputs(config, (2, 8, 8), "cpu")
    step = stand_in_step()
    with torch.no_grad():
        plain = model(**args)[0]
        with step.sdpa(strict=True) as r:
            routed = model(**args)[0]
        with step.sdpa(strict=True) as rc:
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**args)[0]
    assert r.routed == rc.routed == capstone.attention_calls(config) == 4 and not r.fallbacks and not rc.fallbacks
    assert torch.allclose(compiled.float(), routed.float(), atol=2e-2, rtol=2e-2)
    assert models.agreement(routed, plain)["cosine"] > 0.999  # the stand-in computes attention as SDPA does


# ---------------------------------------------------------------- the benchmark, its record, the README section, the chart

@pytest.fixture(scope="module")
def cpu_run(diffusers, tmp_path_factory):
    """benchmark() on CPU: SDPA's default and the stand-in step, eager and compiled (aot_eager), two tiny shapes."""
    torch._dynamo.reset()
    config = tiny_config(layers=1)
    model = capstone.build_transformer(config, "cpu")
    step = stand_in_step()
    rows = [models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext),
            models.Backend("stand_in", "stand-in", lambda: step.sdpa(strict=True)),
            models.Backend("fa3", "FA3", None, "not installed")]
    shapes = [(1, 8, 8), (2, 8, 8)]
    logged = []
    result = capstone.benchmark(model, config, shapes, ["eager", "compile"], rows, warmup=1, iters=3, device="cpu",
                                compile_backend="aot_eager", log=logged.append)
    path = tmp_path_factory.mktemp("results") / "capstone-test.json"
    run = capstone.record(result, meta={"gpu": "no GPU (test)", "torch": torch.__version__, "diffusers": diffusers.__version__},
                          path=path, step="stand_in", config=config, shapes=shapes, modes=["eager", "compile"], rows=rows,
                          timing={"warmup": 1, "iters": 3, "compile_backend": "aot_eager", "fullgraph": True},
                          sdpa_default=None, seconds=1.0)
    capstone.write_results(run, path, log=logged.append)
    torch._dynamo.reset()
    return run, path, logged


def test_the_benchmark_times_every_row_and_counts_the_routed_calls(cpu_run):
    run, _, logged = cpu_run
    for mode in ("eager", "compile"):
        for tokens in ("16", "32"):
            cells = run["runs"][mode][tokens]
            assert cells["fa3"] == {"status": "not installed"}
            for name in ("sdpa_default", "stand_in"):
                c = cells[name]
                assert c["status"] == "ok" and len(c["times_ms"]) == 3 and c["ms"] == sorted(c["times_ms"])[1], c
                assert c["finite"]
            assert cells["stand_in"]["routed"] == run["attention_calls"] == 2 and cells["stand_in"]["fallbacks"] == {}
            # the stand-in's float32 attention rounds otherwise than SDPA's: close, never equal
            assert 0 < cells["stand_in"]["rel_err"] < 1e-2 and cells["stand_in"]["cosine"] > 0.999
            assert cells["sdpa_default"]["rel_err"] == 0 and cells["sdpa_default"]["cosine"] == pytest.approx(1)
    assert any("first call" in line for line in logged) and any("not installed" in line for line in logged)


def test_the_speedups_are_the_ratios_of_the_medians(cpu_run):
    run, _, _ = cpu_run
    for mode, by_tokens in run["runs"].items():
        for tokens, cells in by_tokens.items():
            sp = run["speedup_vs_sdpa_default"][mode][tokens]
            assert sp["sdpa_default"] == 1.0 and "fa3" not in sp
            assert sp["stand_in"] == pytest.approx(cells["sdpa_default"]["ms"] / cells["stand_in"]["ms"])


def test_the_results_file_and_the_chart_are_written(cpu_run):
    run, path, _ = cpu_run
    assert json.loads(path.read_text()) == json.loads(json.dumps(run, default=str))
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_readme_section_is_made_from_the_results_file(cpu_run, tmp_path):
    run, path, _ = cpu_run
    text = capstone.markdown(run)
    cell = run["runs"]["compile"]["16"]["stand_in"]
    sp = run["speedup_vs_sdpa_default"]["compile"]["16"]["stand_in"]
    assert f"| 16 (1×8×8) | {models.ms_text(run['runs']['compile']['16']['sdpa_default']['ms'])} (1.000×) | " \
           f"{models.ms_text(cell['ms'])} ({sp:.3f}×) | not installed |" in text, text
    assert f"{cell['rel_err']:.2e} / {cell['cosine']:.6f}" in text
    assert "stand-in: 2 of 2 attention calls routed per eager forward" in text and f"Source: `{run['path']}`" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{capstone.README_BEGIN}\nold\n{capstone.README_END}\n\nafter\n")
    assert capstone.update_readme(readme, run)
    assert readme.read_text() == f"# x\n\n{capstone.README_BEGIN}\n{text}\n{capstone.README_END}\n\nafter\n"
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("no markers\n")
    assert not capstone.update_readme(unmarked, run) and unmarked.read_text() == "no markers\n"


def test_partial_runs_merge_into_the_run_they_split(cpu_run, tmp_path):
    """Two runs of one shape each (one command each, on the GPU machine) make the record of the run of both shapes."""
    import copy
    run, _, _ = cpu_run
    parts = []
    for i, tokens in enumerate(("16", "32")):
        part = copy.deepcopy(run)
        part["path"], part["shapes"] = f"part{i}.json", {tokens: run["shapes"][tokens]}
        part["runs"] = {m: {tokens: cells[tokens]} for m, cells in run["runs"].items()}
        parts.append(part)
    merged = capstone.merge(parts, tmp_path / "merged.json")
    assert merged["runs"] == run["runs"] and merged["speedup_vs_sdpa_default"] == run["speedup_vs_sdpa_default"]
    assert merged["shapes"] == run["shapes"] and merged["modes"] == run["modes"]
    assert [m["path"] for m in merged["merged_from"]] == ["part0.json", "part1.json"]
    other = copy.deepcopy(parts[1])
    other["step"] = "step07"
    with pytest.raises(ValueError, match="their step differ"):
        capstone.merge([parts[0], other], tmp_path / "merged.json")


def test_a_run_of_record_is_the_full_model_at_both_shapes_in_both_modes(cpu_run):
    import copy
    run, _, _ = cpu_run
    assert not capstone.is_full(run)
    full = copy.deepcopy(run)
    full["model"]["config"] = json.loads(json.dumps(capstone.WAN_T2V_1_3B))
    full["shapes"] = {str(t): list(g) for t, g in capstone.SHAPES.items()}
    full["timing"]["iters"] = 5
    assert capstone.is_full(full)
    for key, value in (("modes", ["eager"]), ("shapes", {"32760": [21, 60, 104]})):
        assert not capstone.is_full({**full, key: value})


def test_regional_compilation_traces_one_block_for_all_and_puts_them_back(diffusers, fresh_compile):
    """--compile-scope blocks: each block compiled, all sharing one traced graph (the router decides a block's two calls
    once for the three blocks), the same outputs as eager, and the model's own blocks back afterwards."""
    config = tiny_config(layers=3)
    model = capstone.build_transformer(config, "cpu")
    blocks = list(model.blocks)
    step = stand_in_step()
    rows = [models.Backend("stand_in", "stand-in", lambda: step.sdpa(strict=True))]
    result = capstone.benchmark(model, config, [(1, 8, 8)], ["eager", "compile"], rows, warmup=0, iters=1, device="cpu",
                                compile_backend="aot_eager", compile_scope="blocks", log=lambda *_: None)
    eager, regional = result["runs"]["eager"]["16"]["stand_in"], result["runs"]["compile"]["16"]["stand_in"]
    assert eager["routed"] == capstone.attention_calls(config) == 6 and regional["routed"] == 2, (eager, regional)
    assert all(a is b for a, b in zip(blocks, model.blocks)) and len(model.blocks) == 3


# ---------------------------------------------------------------- the sample video, on a tiny pipeline

@pytest.fixture(scope="module")
def tiny_pipe(diffusers):
    optional("imageio")
    optional("imageio_ffmpeg")
    return capstone.tiny_pipeline("cpu")


SAMPLE = dict(prompt="a red fox runs in the snow", negative_prompt="", frames=5, height=32, width=32, steps=3,
              guidance=5.0, seed=0, baseline_steps=2, fps=8)


def read_video(path):
    imageio = optional("imageio")
    with imageio.get_reader(path) as reader:
        return [frame for frame in reader]


@pytest.fixture(scope="module")
def final_step():
    """The step the capstone puts in the model: the last one, built (cached) and imported as verify does."""
    return capstone.load_step(steps_mod.all_steps()[-1])


def test_the_sample_path_with_the_step_writes_the_mp4_and_the_contact_sheet(tiny_pipe, final_step, tmp_path):
    """The final step's drop-in around the whole pipeline: on CPU every call goes to torch (CPU tensors), and the video,
    the contact sheet and the record are written."""
    result = capstone.sample(tiny_pipe, final_step, **SAMPLE, stem=tmp_path / "tiny", log=lambda *_: None)
    frames = read_video(tmp_path / "tiny.mp4")
    assert len(frames) == SAMPLE["frames"] and frames[0].shape == (32, 32, 3)
    import matplotlib.image
    sheet = matplotlib.image.imread(tmp_path / "tiny.png")
    assert sheet.shape[:2] == (2 * 32, 4 * 32)  # 5 frames, 4 to a row
    assert json.loads((tmp_path / "tiny.json").read_text()) == json.loads(json.dumps(result, default=str))
    assert result["video_shape"] == [5, 32, 32, 3] and result["routed"] == 0
    calls = capstone.attention_calls(tiny_pipe.transformer.config) * 2 * SAMPLE["steps"]  # CFG: two forwards a step
    assert result["transformer_attention_calls"] == calls
    # the transformer's calls and the VAE's own (its attention), all to torch
    assert list(result["fallbacks"]) == ["the tensors are on cpu; the step runs on cuda tensors"], result["fallbacks"]
    assert sum(result["fallbacks"].values()) > calls
    assert len(result["step_ms"]) == SAMPLE["steps"] - 1 and len(result["sdpa_default_step_ms"]) == 1
    assert "wrote tiny.mp4 and tiny.png" in capstone.sample_summary(result)


def test_in_the_sample_path_the_transformer_s_attention_goes_to_the_step(tiny_pipe, tmp_path):
    """With a step that takes CPU tensors (the stand-in), every attention call of the transformer is routed; the text
    encoder's (a mask) and the VAE's (float32) go to torch."""
    result = capstone.sample(tiny_pipe, stand_in_step(), **{**SAMPLE, "baseline_steps": 0}, stem=tmp_path / "s",
                             log=lambda *_: None)
    assert result["routed"] == result["transformer_attention_calls"] > 0, result
    assert len(read_video(tmp_path / "s.mp4")) == SAMPLE["frames"]


# ---------------------------------------------------------------- the command line

def test_shapes_and_modes_are_read_or_refused():
    assert capstone.parse_shapes("32760,37632") == [capstone.SHAPES[32760], capstone.SHAPES[37632]]
    assert capstone.parse_shapes("2x16x16, 32760") == [(2, 16, 16), capstone.SHAPES[32760]]
    for bad in ("1000", "2x16", "0x2x2", "2x15x16", ""):
        with pytest.raises(ValueError):
            capstone.parse_shapes(bad)
    assert capstone.parse_modes("compile,eager,compile") == ["compile", "eager"]
    with pytest.raises(ValueError, match="eager, compile"):
        capstone.parse_modes("graphs")


def test_the_command_line_says_what_it_lacks_in_one_line(diffusers):
    help_ = subprocess.run([sys.executable, "-m", "verify.capstone", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert help_.returncode == 0 and "--checkpoint" in help_.stdout and "--quick" in help_.stdout, help_.stderr
    bad = subprocess.run([sys.executable, "-m", "verify.capstone", "--shapes", "12"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    missing = subprocess.run([sys.executable, "-m", "verify.capstone", "--checkpoint", str(ROOT)], cwd=ROOT,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "holds no model_index.json" in missing.stderr, missing.stderr
    # no GPU (hidden, so that this runs on the GPU machine too): the benchmark says so before building anything
    no_gpu = subprocess.run([sys.executable, "-m", "verify.capstone", "--quick"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = no_gpu.stderr.strip().splitlines()
    assert no_gpu.returncode != 0 and no_gpu.stdout == "" and len(lines) == 1, no_gpu.stderr
    assert lines[0].startswith("python -m verify.capstone: error:") and "--tiny-pipeline runs anywhere" in lines[0], lines


def test_the_time_per_step_is_said_against_sdpa_default():
    result = {"step": "step14", "step_ms_median": 500.0, "sdpa_default_step_ms_median": 550.0, "routed": 6,
              "transformer_attention_calls": 6, "fallbacks": {"head dim must be 128": 2}, "mp4": "a.mp4",
              "contact_sheet": "a.png"}
    assert capstone.sample_summary(result) == (
        "500 ms per denoising step with step14, 550 ms with SDPA default (1.100×); 6 of 6 transformer attention calls "
        "routed, 2 other calls went to torch (2× head dim must be 128); wrote a.mp4 and a.png")
    on_cpu = dict(result, routed=0, fallbacks={"the tensors are on cpu": 6})
    assert "(no call went to the step: both are torch's times)" in capstone.sample_summary(on_cpu)


def test_an_eager_part_and_a_compile_part_merge_and_compile_settings_must_agree(cpu_run, tmp_path):
    """An eager-only part says nothing about compiling: its compile settings do not stop the merge; two compile parts
    compiled otherwise do not merge."""
    import copy
    run, _, _ = cpu_run
    eager, comp = copy.deepcopy(run), copy.deepcopy(run)
    eager["modes"], eager["runs"] = ["eager"], {"eager": run["runs"]["eager"]}
    comp["modes"], comp["runs"] = ["compile"], {"compile": run["runs"]["compile"]}
    eager["timing"] = dict(run["timing"], compile_scope="model")
    comp["timing"] = dict(run["timing"], compile_scope="blocks")
    merged = capstone.merge([eager, comp], tmp_path / "merged.json")
    assert merged["runs"] == run["runs"] and merged["timing"]["compile_scope"] == "blocks"
    other = copy.deepcopy(comp)
    other["timing"] = dict(comp["timing"], compile_scope="model")
    with pytest.raises(ValueError, match="their timing differ"):
        capstone.merge([comp, other], tmp_path / "merged.json")


def test_a_withdrawn_cell_leaves_the_times_the_speedups_and_the_section_with_its_reason(cpu_run):
    run, _, _ = cpu_run
    out = capstone.withdraw(run, ["compile:stand_in"], "found wrong after the run")
    for tokens, cells in out["runs"]["compile"].items():
        assert cells["stand_in"] == {"status": "withdrawn: found wrong after the run"}
        assert "stand_in" not in out["speedup_vs_sdpa_default"]["compile"][tokens]
        assert out["runs"]["eager"][tokens]["stand_in"] == run["runs"]["eager"][tokens]["stand_in"]
    assert run["runs"]["compile"]["16"]["stand_in"]["status"] == "ok"  # the run itself is left as it was
    text = capstone.markdown(out)
    assert "| withdrawn |" in text and "Withdrawn (compile:stand_in): found wrong after the run." in text
    with pytest.raises(ValueError, match="no such cell"):
        capstone.withdraw(run, ["compile:nothing"], "x")
    with pytest.raises(ValueError, match="reason"):
        capstone.withdraw(run, ["compile:stand_in"], "")


def test_each_compiled_row_is_compiled_with_inductor_s_caches_off(diffusers):
    """A cached graph would hand a row the graph traced under another SDPA backend (what the H200 run of 2026-12-01
    showed): every row compiles with the caches off, and the setting is put back afterwards."""
    import torch._inductor.config as inductor_config
    model = capstone.build_transformer(tiny_config(layers=1), "meta")
    before = inductor_config.force_disable_caches
    with models.compiled(model, "compile", "model", "aot_eager", True):
        assert inductor_config.force_disable_caches is True
    with models.compiled(model, "compile", "blocks", "aot_eager", True):
        assert inductor_config.force_disable_caches is True
    with models.compiled(model, "eager", "model", "aot_eager", True):
        assert inductor_config.force_disable_caches == before
    assert inductor_config.force_disable_caches == before


def test_the_configuration_of_record_is_named_without_a_change(cpu_run):
    """The results file keeps the configuration as JSON does (tuples as lists): that is no change of configuration."""
    import copy
    run, _, _ = cpu_run
    wan = copy.deepcopy(run)
    wan["model"]["config"] = json.loads(json.dumps(capstone.WAN_T2V_1_3B))
    assert "Wan2.1-T2V-1.3B configuration (" in capstone.markdown(wan)
    wan["model"]["config"]["num_layers"] = 2
    assert "Wan2.1-T2V-1.3B configuration but num_layers=2 (" in capstone.markdown(wan)
