"""CPU: python -m verify.prefill's parts (verify/prefill.py) on a tiny LlamaModel made in-process with random weights.

The configuration against transformers' own LlamaConfig; the model as built (bf16, eval, no gradients); what a Llama
prefill passes to SDPA, read from the calls themselves (is_causal=True, enable_gqa=True, no mask), and that every one
of them reaches a stand-in for the step (plain torch attention on CPU behind binding.SdpaRouter with the causal and
GQA features) with causal="top_left" and fewer key/value heads; the benchmark loop, its results file, the README
section; the command line's errors. transformers is optional (requirements-capstone.txt): these tests skip without it,
except in CI (CI=true), where `nox -s tests` installs it.
"""
import contextlib
import importlib
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from verify import models, prefill  # noqa: E402
from verify.tests.test_capstone import optional  # noqa: E402

binding = importlib.import_module("binding")  # common/binding/, on sys.path through verify.steps (prefill imports it)

ROOT = Path(__file__).resolve().parents[2]
F = torch.nn.functional
FEATURES = binding.FEATURE_CAUSAL | binding.FEATURE_GQA
# Llama-3-8B's configuration, smaller everywhere but the head dim (128, what the step takes) and the grouping
# (2 query heads per key/value head; Llama-3-8B has 4).
TINY = {**prefill.LLAMA3_8B, "vocab_size": 64, "hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": None, "eos_token_id": None}
TOKENS = 40


@pytest.fixture(scope="module")
def transformers():
    return optional("transformers")


class StandIn:
    """A step's attention on CPU, as the router calls it: (q, k, v, scale, causal) -> o, in float32 with k/v's heads
    repeated (query head h reads key/value head h // (heads // heads_k)); every call kept."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, scale, causal=False):
        self.calls.append({"causal": causal, "q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "scale": scale})
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).float() for t in (k, v))
        nq, nk = q.shape[2], k.shape[2]
        s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
        if causal:
            offset = 0 if causal == "top_left" else nk - nq
            s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + offset, -math.inf)
        return torch.matmul(s.softmax(-1), v).to(q.dtype)


def stand_in_router(attention, strict=True):
    limits = binding.SdpaLimits("stand_in", devices=("cpu",), features=FEATURES)
    return binding.SdpaRouter(attention, limits, strict, name="stand_in.sdpa")


@pytest.fixture(scope="module")
def tiny(transformers):
    return prefill.build_model(TINY, "cpu")


# ---------------------------------------------------------------- the configuration and the model

def test_the_configuration_is_llama3_8b_and_transformers_takes_it(transformers):
    cfg = prefill.llama_config(prefill.LLAMA3_8B)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (4096, 32, 32, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (14336, 128256, 128)
    assert cfg.max_position_embeddings >= prefill.TOKENS == 8192
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == 500000.0
    assert cfg._attn_implementation == "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaModel(cfg)
    assert not hasattr(model, "lm_head")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(7.5, abs=0.05), "not Llama-3-8B's decoder"
    assert prefill.attention_calls(model) == 32
    assert prefill.llama_config(prefill.LLAMA3_8B, layers=2).num_hidden_layers == 2


def test_the_model_is_made_in_bf16_in_eval_mode_without_gradients(tiny):
    assert {p.dtype for p in tiny.parameters()} == {torch.bfloat16}
    assert {b.dtype for _, b in tiny.named_buffers()} == {torch.float32}  # RoPE's inverse frequencies, as transformers makes them
    assert not tiny.training and not any(p.requires_grad for p in tiny.parameters())
    assert tiny.config._attn_implementation == "sdpa" and torch.get_default_dtype() == torch.float32
    again = prefill.build_model(TINY, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters())), "the weights are not seeded"


def test_the_model_is_made_on_the_device_asked_for(transformers):
    model = prefill.build_model(TINY, "meta", layers=1)
    assert {p.device.type for p in model.parameters()} == {"meta"} and len(model.layers) == 1


def test_the_inputs_are_seeded_token_ids_without_a_mask():
    a, b = prefill.make_inputs(TINY, TOKENS, "cpu"), prefill.make_inputs(TINY, TOKENS, "cpu")
    assert set(a) == {"input_ids"} and a["input_ids"].shape == (1, TOKENS) and torch.equal(a["input_ids"], b["input_ids"])
    assert 0 <= int(a["input_ids"].min()) and int(a["input_ids"].max()) < TINY["vocab_size"]


# ---------------------------------------------------------------- what a prefill passes to SDPA, and the drop-in

def sdpa_calls(model, **kwargs):
    with torch.no_grad(), prefill.SdpaCalls() as calls:
        model(**prefill.make_inputs(TINY, TOKENS, "cpu"), **kwargs)
    return calls.summary()


@pytest.mark.parametrize("kwargs", [{}, {"use_cache": False}, {"attention_mask": torch.ones(1, TOKENS, dtype=torch.long)}],
                         ids=["as the prefill runs", "without a cache", "a mask of all ones"])
def test_a_llama_prefill_calls_sdpa_causal_with_grouped_heads_and_no_mask(tiny, kwargs):
    """What transformers' sdpa_attention_forward passes: is_causal=True, enable_gqa=True, no attn_mask, the default
    scale, k/v with the configuration's key/value heads; one call per layer."""
    summary = sdpa_calls(tiny, **kwargs)
    assert len(summary) == 1 and summary[0]["calls"] == TINY["num_hidden_layers"], summary
    call = summary[0]["call"]
    assert call["is_causal"] is True and call["enable_gqa"] is True and call["attn_mask"] is None
    assert call["dropout_p"] == 0.0 and call["scale"] == pytest.approx(128**-0.5)
    assert call["query"]["shape"] == [1, TINY["num_attention_heads"], TOKENS, 128]
    assert call["key"]["shape"] == call["value"]["shape"] == [1, TINY["num_key_value_heads"], TOKENS, 128]
    assert prefill.call_in_words(call) == ("is_causal=True, enable_gqa=True, no mask, q [1, 4, 40, 128], "
                                           "k/v [1, 2, 40, 128]")


def test_padding_makes_an_explicit_mask_that_the_drop_in_does_not_take(tiny):
    """The case the prefill avoids: a padded prompt (a 0 in attention_mask) makes transformers build a boolean mask,
    and then it passes enable_gqa=False with k/v repeated to every query head."""
    mask = torch.ones(1, TOKENS, dtype=torch.long)
    mask[0, :3] = 0
    call = sdpa_calls(tiny, attention_mask=mask)[0]["call"]
    assert call["is_causal"] is False and call["attn_mask"]["dtype"] == "bool" and call["attn_mask"]["shape"] == [1, 1, TOKENS, TOKENS]
    with pytest.raises(binding.NotRouted, match="attn_mask is given"):
        with torch.no_grad(), stand_in_router(StandIn()):
            tiny(**prefill.make_inputs(TINY, TOKENS, "cpu"), attention_mask=mask)


def test_every_attention_call_of_a_prefill_reaches_the_stand_in_causal_with_fewer_kv_heads(tiny):
    stand_in = StandIn()
    inputs = prefill.make_inputs(TINY, TOKENS, "cpu")
    with torch.no_grad():
        plain = tiny(**inputs).last_hidden_state
        with stand_in_router(stand_in) as r:
            routed = tiny(**inputs).last_hidden_state
    assert r.routed == len(stand_in.calls) == TINY["num_hidden_layers"] and not r.fallbacks
    for call in stand_in.calls:
        assert call["causal"] == "top_left"
        assert call["q"] == (1, TINY["num_attention_heads"], TOKENS, 128)
        assert call["k"] == call["v"] == (1, TINY["num_key_value_heads"], TOKENS, 128)
        assert call["scale"] == pytest.approx(128**-0.5)
    agree = models.agreement(routed, plain)
    assert agree["cosine"] > 0.9999 and agree["rel_err"] < 2e-2  # the stand-in computes what SDPA does


def test_a_stand_in_without_causal_gets_no_call():
    """The router's own rule, as the prefill relies on it: without the causal feature a causal call falls back."""
    limits = binding.SdpaLimits("stand_in", devices=("cpu",), features=binding.FEATURE_GQA)
    q, k = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    with binding.SdpaRouter(StandIn(), limits) as r:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    assert r.routed == 0 and list(r.fallbacks) == ["is_causal=True: the step is non-causal"]


# ---------------------------------------------------------------- the rows

def fake_step(causal=True, gqa=True, attention=None):
    return types.SimpleNamespace(info={"step": "step15", "causal": causal, "gqa": gqa},
                                 sdpa=lambda strict=False: stand_in_router(attention or StandIn(), strict))


def test_the_rows_and_their_order():
    rows = prefill.backends(fake_step(), fa3=(None, "not installed (here)"))
    assert [r.name for r in rows] == ["sdpa_default", "sdpa_flash", "sdpa_cudnn", "step15", "fa3"]
    assert rows[-1].context is None and rows[-1].unavailable == "not installed (here)"
    assert all(r.context is not None for r in rows[:-1])
    with rows[3].context() as router:
        assert router.strict and router.limits.features == FEATURES
    fa3 = prefill.backends(fake_step(), fa3=(StandIn(), "a stand-in"))[-1]
    with fa3.context() as router:
        assert router.strict and router.limits.features == FEATURES and router.limits.archs == ("sm_90a",)
    assert fa3.source == "a stand-in"


@pytest.mark.parametrize("causal, gqa, lacks", [(False, True, "causal masks"), (True, False, "grouped key/value heads"),
                                                (False, False, "causal masks and no grouped key/value heads")])
def test_a_step_without_causal_or_gqa_is_a_row_that_says_so(causal, gqa, lacks):
    row = prefill.backends(fake_step(causal, gqa), fa3=(None, "-"))[3]
    assert row.context is None and row.unavailable == f"not run: step15 takes no {lacks} (step15 on)"


def test_fa3_absent_is_said_not_raised():
    try:
        import fa3_fwd_interface  # noqa: F401
        pytest.skip("fa3-fwd is installed here")
    except ImportError:
        pass
    fn, why = prefill.fa3_attention()
    assert fn is None and why.startswith("not installed")


# ---------------------------------------------------------------- the benchmark, its record, the README section

@pytest.fixture(scope="module")
def cpu_run(tiny, tmp_path_factory):
    """benchmark() on CPU: SDPA's default and FLASH (torch's CPU kernels), cuDNN (refused on CPU), the stand-in step,
    FA3 absent, and a step whose router routes nothing (a failed row)."""
    stand_in = StandIn()
    step = fake_step(attention=stand_in)
    rows = prefill.backends(step, fa3=(None, "not installed (test)"))
    nothing = binding.SdpaLimits("nothing", devices=("meta",), features=FEATURES)
    rows.append(models.Backend("strict_nowhere", "nowhere", lambda: binding.SdpaRouter(StandIn(), nothing, True)))
    logged = []
    result = prefill.benchmark(tiny, prefill.make_inputs(TINY, TOKENS, "cpu"), rows, warmup=2, warmup_s=0.0, iters=3,
                               device="cpu", log=logged.append)
    path = tmp_path_factory.mktemp("results") / "prefill-test.json"
    run = prefill.record(result, meta={"gpu": "no GPU (test)", "torch": torch.__version__, "transformers": "test"},
                         path=path, step="step15", config=TINY, tokens=TOKENS, rows=rows,
                         timing={"warmup": 2, "warmup_s": 0.0, "iters": 3}, sdpa_default=None, seconds=1.0)
    prefill.write_results(run, path, log=logged.append)
    return run, path, logged, stand_in


def test_the_benchmark_times_every_row_and_counts_the_routed_calls(cpu_run):
    run, _, logged, stand_in = cpu_run
    rows = run["rows"]
    for name in ("sdpa_default", "sdpa_flash", "step15"):
        c = rows[name]
        assert c["status"] == "ok" and len(c["times_ms"]) == 3 and c["ms"] == sorted(c["times_ms"])[1], c
        assert c["warmup_forwards"] == 2 and c["finite"]
    step = rows["step15"]
    assert step["routed"] == step["routed_per_forward"] == run["attention_calls"] == 2 and step["fallbacks"] == {}
    assert step["routed_every_forward"] and len(stand_in.calls) == 2 * (1 + 2 + 3)  # first, warm-up, timed forwards
    assert rows["sdpa_default"]["rel_err"] == 0 and rows["sdpa_default"]["cosine"] == pytest.approx(1)
    assert 0 < step["rel_err"] < 2e-2 and step["cosine"] > 0.9999
    assert rows["sdpa_flash"]["rel_err"] < 2e-2
    assert rows["sdpa_cudnn"]["status"].startswith("not supported: ") and "ms" not in rows["sdpa_cudnn"]
    assert rows["fa3"] == {"status": "not installed (test)"}
    assert rows["strict_nowhere"]["status"].startswith("failed: NotRouted")
    assert "fa3" not in run["speedup_vs_sdpa_default"] and run["speedup_vs_sdpa_default"]["sdpa_default"] == 1.0
    assert run["speedup_vs_sdpa_default"]["step15"] == pytest.approx(rows["sdpa_default"]["ms"] / step["ms"])
    assert [c["calls"] for c in run["sdpa_calls"]] == [2] and run["sdpa_calls"][0]["call"]["is_causal"] is True
    assert any(line.startswith("[4/6] step15: ") and "2 of 2 calls routed" in line for line in logged), logged
    assert any("[6/6] nowhere: failed" in line for line in logged), logged


def test_the_results_file_is_what_the_run_recorded(cpu_run):
    run, path, _, _ = cpu_run
    assert json.loads(path.read_text()) == json.loads(json.dumps(run, default=str))
    assert run["kind"] == "prefill" and run["model"]["lm_head"] is False and run["tokens"] == TOKENS
    assert run["model"]["config"] == TINY and not prefill.is_full(run)
    full = json.loads(json.dumps(run))
    full["model"]["config"], full["tokens"], full["timing"]["iters"] = json.loads(json.dumps(prefill.LLAMA3_8B)), 8192, 10
    assert prefill.is_full(full)
    assert not prefill.is_full({**full, "tokens": 4096})


def test_the_readme_section_is_made_from_the_results_file(cpu_run, tmp_path):
    run, path, _, _ = cpu_run
    text = prefill.markdown(json.loads(path.read_text()))
    rows, sp = run["rows"], run["speedup_vs_sdpa_default"]
    assert text.splitlines()[0] == ("| prefill, 40 tokens, batch 1 | SDPA default | SDPA FLASH | SDPA cuDNN | step15 | FA3 "
                                    "| nowhere |")
    assert (f"| ms per forward (× SDPA default) | {prefill._ms(rows['sdpa_default']['ms'])} (1.000×) | "
            f"{prefill._ms(rows['sdpa_flash']['ms'])} ({sp['sdpa_flash']:.3f}×) | not supported | "
            f"{prefill._ms(rows['step15']['ms'])} ({sp['step15']:.3f}×) | not installed | failed |") in text, text
    step = rows["step15"]
    # on CPU SDPA's default is its FLASH kernel: an error of 0, of which no multiple is shown
    assert rows["sdpa_flash"]["rel_err"] == 0 and f"| {step['rel_err']:.2e} / {step['cosine']:.6f} |" in text
    with_flash = json.loads(json.dumps(run))
    with_flash["rows"]["sdpa_flash"]["rel_err"] = step["rel_err"] / 2  # a synthetic figure: the column's arithmetic
    assert f"{step['rel_err']:.2e} / {step['cosine']:.6f}, 2.00× FLASH's" in prefill.markdown(with_flash)
    assert "| attention calls routed per forward | - | - | - | 2 of 2 | - | - |" in text
    assert "but vocab_size=64" in text and "2× is_causal=True, enable_gqa=True, no mask" in text
    assert "(no LM head)" in text and f"Source: `{run['path']}`" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{prefill.README_BEGIN}\nold\n{prefill.README_END}\n\nafter\n")
    assert prefill.update_readme(readme, run)
    assert readme.read_text() == f"# x\n\n{prefill.README_BEGIN}\n{prefill.markdown(run)}\n{prefill.README_END}\n\nafter\n"
    unmarked = tmp_path / "unmarked.md"
    unmarked.write_text("no markers\n")
    assert not prefill.update_readme(unmarked, run) and unmarked.read_text() == "no markers\n"
    assert prefill.readme_section(None) == prefill.NO_RUN_YET
    assert "SDPA calls of one forward: 2× is_causal=True" in prefill.console_summary(run)


def test_the_newest_run_of_record_is_found(cpu_run, tmp_path):
    run, _, _, _ = cpu_run
    full = json.loads(json.dumps(run))
    full["model"]["config"], full["tokens"], full["timing"]["iters"] = json.loads(json.dumps(prefill.LLAMA3_8B)), 8192, 10
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    for stamp, r in (("2026-01-01", full), ("2026-01-02", run), ("2025-12-31", {**full, "path": "older"})):
        (folder / f"prefill-{stamp}.json").write_text(json.dumps(r))
    assert prefill.newest_full_run(tmp_path) == full and prefill.newest_full_run(tmp_path / "none") is None


def test_warm_up_runs_at_least_so_many_forwards_and_seconds():
    count = []
    assert prefill.warm_up(lambda: count.append(1), 3, 0.0, "cpu")[0] == 3 == len(count)
    n, s = prefill.warm_up(lambda: None, 0, 0.05, "cpu")
    assert n >= 1 and s >= 0.05
    assert prefill.warm_up(lambda: None, 0, 0.0, "cpu") == (0, pytest.approx(0, abs=0.01))


def test_results_paths():
    path = prefill.results_path("NVIDIA H200", ROOT, stamp="2026-12-01T00-00-00Z")
    assert path == ROOT / "results" / "h200" / "prefill-2026-12-01T00-00-00Z.json"
    assert prefill.PREFILL_GLOB == "results/*/prefill-*.json" and prefill.SMOKE_ROOT == ROOT / "build" / "prefill"


# ---------------------------------------------------------------- the command line

def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "verify.prefill", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def one_line_error(out, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith("python -m verify.prefill: error:"), out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("args, words", [
    (["--tokens", "0"], ["--tokens", "must be at least 1"]),
    (["--tokens", "abc"], ["--tokens", "cannot read 'abc'"]),
    (["--tokens", "9000"], ["--tokens", "8192 positions"]),
    (["--layers", "0"], ["--layers", "must be at least 1"]),
    (["--iters", "0"], ["--iters", "must be at least 1"]),
    (["--warmup", "-1"], ["--warmup", "must be at least 0"]),
    (["--warmup-s", "nan"], ["--warmup-s", "must be at least 0.0"]),
    (["--report", "no/such/file.json"], ["--report", "is not a file"]),
    (["--readme", "maybe"], ["--readme", "invalid choice"]),
    (["--step", "abc"], ["--step", "'abc'"]),
])
def test_a_bad_command_line_is_one_line(args, words):
    with pytest.raises(SystemExit) as e:
        with contextlib.redirect_stderr(sys.stdout):
            prefill.parse_args(args)
    assert e.value.code == 2
    one_line_error(run_cli(*args), *words)


def test_quick_and_the_defaults():
    args = prefill.parse_args([])
    assert (args.tokens, args.layers, args.warmup, args.warmup_s, args.iters) == (8192, None, 3, 2.0, 10)
    quick = prefill.parse_args(["--quick"])
    assert (quick.tokens, quick.layers, quick.warmup, quick.warmup_s, quick.iters) == (8192, 2, 1, 0.0, 2)
    assert prefill.parse_args(["--quick", "--layers", "4", "--tokens", "1024"]).layers == 4


def test_help_and_no_gpu_are_said_in_one_line(transformers):
    help_ = run_cli("--help")
    assert help_.returncode == 0 and all(f in help_.stdout for f in ("--quick", "--layers", "--report", "--tokens")), help_.stderr
    # no GPU (hidden, so that this runs on the GPU machine too): said before building anything
    no_gpu = run_cli("--quick", env={"CUDA_VISIBLE_DEVICES": ""})
    one_line_error(no_gpu, "--report works anywhere")
    assert no_gpu.stdout == ""


def test_the_report_of_a_results_file(cpu_run, tmp_path):
    run, path, _, _ = cpu_run
    out = run_cli("--report", str(path), "--readme", "no")
    assert out.returncode == 0 and prefill.markdown(run) in out.stdout, out.stderr
    other = tmp_path / "capstone.json"
    other.write_text(json.dumps({"kind": "capstone"}))
    one_line_error(run_cli("--report", str(other)), "is not a prefill results file")
