"""CPU: python -m verify.cogvideox's parts (verify/cogvideox.py): CogVideoX-2B's configuration and its shape of record
against diffusers' own class, a tiny CogVideoXTransformer3DModel (head dim 64) whose every attention call goes through
the drop-in, the benchmark's record, the docs section and the chart. diffusers is optional (requirements-capstone.txt):
these tests skip without it, except in CI (test_capstone.optional)."""
import contextlib
import inspect
import json
import types

import pytest

torch = pytest.importorskip("torch")

from verify import cogvideox, models  # noqa: E402
from verify.tests.test_capstone import optional  # noqa: E402
from verify.tests.test_sdpa_router import CPU_LIMITS, binding, stand_in_attention  # noqa: E402

LIMITS_64 = CPU_LIMITS._replace(step="stand_in_64", head_dims=(64, 128))  # a stand-in that takes head dim 64, as step41


@pytest.fixture(scope="module")
def diffusers():
    optional("transformers")
    return optional("diffusers")


def tiny_config(layers=2):
    """CogVideoX-2B's configuration, smaller everywhere but the head dim (64: what this model is here for)."""
    return {**cogvideox.COGVIDEOX_2B, "num_attention_heads": 2, "time_embed_dim": 32, "text_embed_dim": 32,
            "num_layers": layers, "max_text_seq_length": 8, "sample_width": 8, "sample_height": 8, "sample_frames": 5}


def stand_in_step():
    return types.SimpleNamespace(
        info={"step": "stand_in", "head_dims": [64, 128]},
        sdpa=lambda strict=False: binding.SdpaRouter(stand_in_attention, LIMITS_64, strict, name="stand_in_64.sdpa"))


def test_the_configuration_is_diffusers_cogvideox_2b(diffusers):
    """Every value is the class's default, which is CogVideoX-2B's configuration: 30 heads of 64 (1920 wide), 30 layers,
    a model of 1.7B parameters."""
    params = inspect.signature(diffusers.CogVideoXTransformer3DModel.__init__).parameters
    assert {k: params[k].default for k in cogvideox.COGVIDEOX_2B} == cogvideox.COGVIDEOX_2B
    with torch.device("meta"):
        model = diffusers.CogVideoXTransformer3DModel(**cogvideox.COGVIDEOX_2B)
    assert model.config.num_attention_heads * model.config.attention_head_dim == 1920
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(1.7, abs=0.1), "not CogVideoX-2B's size"


@pytest.mark.parametrize("tokens", sorted(cogvideox.SHAPES))
def test_the_shape_of_record_gives_its_token_count_in_diffusers_model(diffusers, tokens):
    """49 frames at 480x720 as latents, embedded with the text by the model's own patch embedding: that many tokens."""
    config = cogvideox.COGVIDEOX_2B
    with torch.device("meta"):
        model = diffusers.CogVideoXTransformer3DModel(**{**config, "num_layers": 1}).to(torch.float16)
    args = cogvideox.make_inputs(config, cogvideox.SHAPES[tokens], "meta")
    assert args["hidden_states"].shape == (cogvideox.BATCH, 13, 16, 60, 90)
    embedded = model.patch_embed(args["encoder_hidden_states"], args["hidden_states"])
    assert embedded.shape[1] == tokens == cogvideox.tokens_of(config, cogvideox.SHAPES[tokens]) == 226 + 13 * 30 * 45


def test_every_attention_call_goes_through_the_drop_in_at_head_dim_64(diffusers):
    """A tiny CogVideoX, its attention calls (one per block, head dim 64) taken by a stand-in that takes 64: all of them,
    in eager and compiled whole with fullgraph=True; a step that takes 128 alone gets none, and says why."""
    torch._dynamo.reset()
    config = tiny_config()
    model = cogvideox.build_transformer(config, "cpu", "bfloat16")
    args = cogvideox.make_inputs(config, (2, 8, 8), "cpu", "bfloat16")
    step = stand_in_step()
    with torch.no_grad():
        plain = model(**args)[0]
        with step.sdpa(strict=True) as r:
            routed = model(**args)[0]
        with step.sdpa(strict=True) as rc:
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(**args)[0]
        with binding.SdpaRouter(stand_in_attention, CPU_LIMITS, False, name="stand_in_128.sdpa") as r128:
            model(**args)
    torch._dynamo.reset()
    assert r.routed == rc.routed == cogvideox.attention_calls(config) == 2 and not r.fallbacks and not rc.fallbacks
    assert torch.allclose(compiled.float(), routed.float(), atol=2e-2, rtol=2e-2)
    assert models.agreement(routed, plain)["cosine"] > 0.999
    assert r128.routed == 0 and list(r128.fallbacks) == [
        "q has head dim 64 (shape (2, 2, 40, 64)); this step takes 128 (64: step41 on)"], r128.fallbacks


@pytest.fixture(scope="module")
def cpu_run(diffusers, tmp_path_factory):
    """models.benchmark() with CogVideoX's inputs on CPU: SDPA's default and the stand-in, eager, one tiny shape."""
    config = tiny_config(layers=1)
    model = cogvideox.build_transformer(config, "cpu", "bfloat16")
    step = stand_in_step()
    rows = [models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext),
            models.Backend("stand_in", "stand-in", lambda: step.sdpa(strict=True)),
            models.Backend("fa3", "FA3", None, "not installed")]
    shapes = [(2, 8, 8)]
    inputs = {cogvideox.tokens_of(config, g): cogvideox.make_inputs(config, g, "cpu", "bfloat16") for g in shapes}
    result = models.benchmark(model, config, shapes, ["eager"], rows, warmup=1, iters=3, device="cpu", inputs=inputs,
                                log=lambda m: None)
    path = tmp_path_factory.mktemp("results") / "cogvideox-test.json"
    run = cogvideox.record(result, meta={"gpu": "no GPU (test)", "torch": torch.__version__, "diffusers": diffusers.__version__},
                           path=path, step="stand_in", config=config, dtype="bfloat16", shapes=shapes, modes=["eager"],
                           rows=rows, timing={"warmup": 1, "iters": 3, "compile_backend": "inductor", "fullgraph": True},
                           seconds=1.0)
    models.write_results_and_chart(run, path, log=lambda m: None)
    return run, path


def test_the_benchmark_routes_every_call_and_records_the_model(cpu_run):
    run, path = cpu_run
    cells = run["runs"]["eager"]["40"]
    assert run["shapes"] == {"40": [2, 8, 8]} and run["attention_calls"] == 1 and run["kind"] == "cogvideox"
    assert cells["stand_in"]["status"] == "ok" and cells["stand_in"]["routed"] == 1 and cells["stand_in"]["fallbacks"] == {}
    assert 0 < cells["stand_in"]["rel_err"] < 2e-2 and cells["fa3"] == {"status": "not installed"}
    assert run["model"]["class"] == "CogVideoXTransformer3DModel" and run["model"]["dtype"] == "bfloat16"
    assert json.loads(path.read_text()) == json.loads(json.dumps(run, default=str))
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_section_is_made_from_the_results_file_and_a_run_of_record_is_the_full_model(cpu_run, tmp_path):
    run, _ = cpu_run
    text = cogvideox.markdown(run)
    cell = run["runs"]["eager"]["40"]["stand_in"]
    assert f"{models.ms_text(cell['ms'])} ({run['speedup_vs_sdpa_default']['eager']['40']['stand_in']:.3f}×)" in text
    assert "but 1 layers" in text and "head dim 64" in text and f"Source: `{run['path']}`" in text
    page = tmp_path / "capstone.md"
    page.write_text(f"# x\n\n{cogvideox.README_BEGIN}\nold\n{cogvideox.README_END}\n")
    assert cogvideox.update_readme(page, run) and text in page.read_text()
    assert not cogvideox.is_full(run)
    full = json.loads(json.dumps(run))
    full["model"]["config"], full["model"]["dtype"] = json.loads(json.dumps(cogvideox.COGVIDEOX_2B)), "float16"
    full["shapes"], full["modes"], full["timing"]["iters"] = {"17776": [13, 60, 90]}, ["eager", "compile"], 5
    assert cogvideox.is_full(full)
    assert not cogvideox.is_full({**full, "model": {**full["model"], "dtype": "bfloat16"}})


def test_the_docs_section_is_the_newest_run_of_record_or_says_there_is_none():
    run = models.newest_run(cogvideox.GLOB, cogvideox.is_full)
    page = models.MODELS_PAGE.read_text()
    body = page.split(cogvideox.README_BEGIN, 1)[1].split(cogvideox.README_END, 1)[0].strip()
    assert body == cogvideox.readme_section(run).strip()


def test_shapes_are_read_or_refused():
    assert cogvideox.parse_shapes("17776") == [(13, 60, 90)]
    assert cogvideox.parse_shapes("2x16x16, 13x60x90") == [(2, 16, 16), (13, 60, 90)]
    for bad in ("100", "2x15x16", "2x16", "axbxc"):
        with pytest.raises(ValueError):
            cogvideox.parse_shapes(bad)


def test_fa3_rows_take_head_dim_64_and_fp16():
    """FA3's row goes through the drop-in's router with FA3's own limits: fp16 and every head dim it takes, so that its
    row of this model (fp16, head dim 64) is routed, not refused."""
    step = types.SimpleNamespace(info={"step": "stepX"}, sdpa=lambda strict=False: None)
    fa3 = [r for r in models.backends(step, fa3=(lambda q, k, v, scale, causal=False: q, "test")) if r.name == "fa3"][0]
    limits = fa3.context().limits
    assert 64 in limits.head_dims and 128 in limits.head_dims and limits.features & binding.FEATURE_FP16


def test_report_regenerates_the_section_and_the_chart_without_a_gpu(cpu_run, tmp_path, monkeypatch):
    """--report FILE: the docs section and the chart from a results file; a missing file or another kind of results
    file is refused in one line."""
    run, path = cpu_run
    page = tmp_path / "capstone.md"
    page.write_text(f"{cogvideox.README_BEGIN}\nold\n{cogvideox.README_END}\n")
    monkeypatch.setattr(models, "MODELS_PAGE", page)
    path.with_suffix(".png").unlink()
    assert cogvideox.main(["--report", str(path)]) == 0
    assert cogvideox.markdown(run) in page.read_text() and path.with_suffix(".png").exists()
    with pytest.raises(SystemExit):
        cogvideox.main(["--report", str(tmp_path / "missing.json")])
    other = tmp_path / "capstone-x.json"
    other.write_text(json.dumps({"kind": "capstone"}))
    with pytest.raises(SystemExit, match="is not a CogVideoX results file"):
        cogvideox.main(["--report", str(other)])
