"""CPU: python -m verify.train's parts (verify/train.py) on a tiny Qwen2ForCausalLM made in-process with random weights.

The configuration against transformers' own Qwen2Config (Qwen2.5-1.5B's size); training steps with SDPA's default and
with a stand-in for the step behind binding.SdpaRouter (plain torch attention on CPU, gradients through autograd),
every call of which must be routed, forward and backward: their losses and gradients agree; a router that does not
take calls needing gradients fails its row (the check bites); the results file's table and note; the command line.
transformers is optional (requirements-capstone.txt): these tests skip without it, except in CI.
"""
import contextlib
import importlib
import json

import pytest

torch = pytest.importorskip("torch")

from verify import models, train  # noqa: E402
from verify.tests.test_capstone import optional  # noqa: E402
from verify.tests.test_capstone import tiny_config as tiny_wan  # noqa: E402
from verify.tests.test_prefill import FEATURES, StandIn  # noqa: E402

binding = importlib.import_module("binding")

# Qwen2.5-1.5B's configuration, smaller everywhere but the head dim (128) and the grouping (2 query heads per key/value
# head; Qwen2.5-1.5B has 6).
TINY = {**train.QWEN25_1_5B, "vocab_size": 64, "hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": None, "eos_token_id": None}
TOKENS = 40


@pytest.fixture(scope="module")
def transformers():
    return optional("transformers")


def stand_in(backward=True):
    limits = binding.SdpaLimits("stand_in", devices=("cpu",), features=FEATURES, backward=backward)
    return models.Backend("stand_in", "stand-in", lambda: binding.SdpaRouter(StandIn(), limits, True, name="stand_in.sdpa"))


def run(rows, warmup=1, iters=2):
    logs = []
    result = train.benchmark(TINY, train.make_batch(TINY, TOKENS, "cpu"), rows, warmup=warmup, iters=iters,
                             device="cpu", log=logs.append)
    return result["rows"], logs


def test_the_configuration_is_qwen25_1_5b_and_transformers_takes_it(transformers):
    cfg = transformers.Qwen2Config(**train.QWEN25_1_5B, attn_implementation="sdpa")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (1536, 28, 12, 2)
    assert cfg.hidden_size // cfg.num_attention_heads == 128 and cfg.tie_word_embeddings
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(1.54, abs=0.01), "not Qwen2.5-1.5B's size"


def test_a_training_step_through_the_drop_in_agrees_with_sdpa(transformers):
    """Every attention call of every step routed (forward and backward through the stand-in); the first step's loss
    and gradients as SDPA default's, up to bf16 rounding."""
    rows, logs = run([models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext), stand_in()])
    ref, step = rows["sdpa_default"], rows["stand_in"]
    assert ref["status"] == "ok" and "grad_rel_err" not in ref, ref
    assert step["status"] == "ok", step
    assert step["routed_per_step"] == TINY["num_hidden_layers"] and step["routed_every_step"]
    assert abs(step["loss_diff"]) < 1e-2 and step["grads_finite"]
    assert step["grad_rel_err"] < 5e-2 and step["grad_cosine"] > 0.99, step
    assert len(step["times_ms"]) == 2 and len(logs) == 2


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_transformers_checkpointing_given_the_router_s_contexts_routes_the_recompute(transformers):
    """transformers' gradient checkpointing with the drop-in's contexts in its kwargs (use_reentrant=False, context_fn=
    router.checkpoint_contexts): every layer's attention routed in the forward and again in the recompute, strict, and
    the gradients those of the same model and router without checkpointing."""
    batch = train.make_batch(TINY, TOKENS, "cpu")
    router = stand_in().context

    def first_step(checkpointing):
        model = train.build_model(TINY, "cpu")
        if checkpointing:
            with router() as r:  # any router of the step and settings: the contexts name its key
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": r.checkpoint_contexts})
        with router() as r:
            model(**batch).loss.backward()
        return r, [p.grad for p in model.parameters() if p.grad is not None]
    plain, want = first_step(False)
    checkpointed, got = first_step(True)
    layers = TINY["num_hidden_layers"]
    assert (plain.routed, plain.recomputed) == (layers, 0) and not plain.fallbacks
    assert (checkpointed.routed, checkpointed.recomputed) == (layers, layers) and not checkpointed.fallbacks
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_drop_in_that_leaves_the_backward_to_torch_fails_its_row(transformers):
    """A router that does not take calls needing gradients (strict) raises on the first: the row fails, saying why."""
    rows, _ = run([stand_in(backward=False)])
    assert rows["stand_in"]["status"].startswith("failed:"), rows


def test_the_table_and_the_note_come_from_the_results(transformers, tmp_path):
    rows = [models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext), stand_in(),
            models.Backend("absent", "absent", None, "not installed (x)")]
    result = train.benchmark(TINY, train.make_batch(TINY, TOKENS, "cpu"), rows, warmup=0, iters=1, device="cpu",
                             log=lambda m: None)
    meta = {"gpu": "cpu", "torch": torch.__version__, "transformers": "t"}
    rec = train.record(result, meta=meta, path=tmp_path / "train-x.json", step="stand_in", config=TINY, tokens=TOKENS,
                       rows=rows, timing={"warmup": 0, "iters": 1}, seconds=1.0)
    text = train.markdown(json.loads(json.dumps(rec)))
    assert "| Qwen2.5-1.5B training step, 40 tokens, batch 1 | SDPA default | stand-in | absent |" in text
    assert "| attention calls routed per step | - | 2 of 2 | - |" in text and "reference" in text
    assert models.short_status({"status": "not installed (x)"}) in text and "but vocab_size=64" in text
    assert not train.is_full(rec)


@pytest.fixture(scope="module")
def diffusers():
    optional("transformers")
    return optional("diffusers")


def test_a_wan_training_step_through_the_drop_in_agrees_with_sdpa(diffusers):
    """The Wan model: every attention call of a step routed (a self- and a cross-attention per block, forward and
    backward the stand-in's); its loss and gradients as SDPA default's."""
    spec = train.MODELS["wan"]
    config = {**tiny_wan(), "num_layers": 2}
    rows = [models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext), stand_in()]
    result = train.benchmark(config, spec.batch(config, (2, 8, 8), "cpu"), rows, warmup=0, iters=1, device="cpu",
                             log=lambda m: None, spec=spec)["rows"]
    step = result["stand_in"]
    assert result["sdpa_default"]["status"] == "ok" and step["status"] == "ok", result
    assert step["routed_per_step"] == spec.calls(config) == 2 * 2 and step["routed_every_step"]
    assert abs(step["loss_diff"]) < 1e-2 and step["grad_cosine"] > 0.99, step


def test_with_gradient_checkpointing_every_call_is_routed_in_the_forward_and_the_recompute(diffusers):
    """Gradient checkpointing through binding.checkpoint: each block's forward runs again in the backward under the
    drop-in's contexts, so a strict row routes every call in the forward and again in the recompute, and its loss and
    gradients agree with SDPA default's (checkpointed too). With torch's own checkpoint the strict row fails, saying
    why (the check bites)."""
    spec = train.with_checkpointing(train.MODELS["wan"])
    config = {**tiny_wan(), "num_layers": 1}
    rows = [models.Backend("sdpa_default", "SDPA default", contextlib.nullcontext), stand_in()]
    recomputed = []
    real = binding.SdpaRouter.checkpoint

    def spy(self, function, *args, **kwargs):
        out = real(self, function, *args, **kwargs)
        recomputed.append(self)
        return out
    binding.SdpaRouter.checkpoint = spy
    try:
        result = train.benchmark(config, spec.batch(config, (2, 8, 8), "cpu"), rows, warmup=0, iters=1, device="cpu",
                                 log=lambda m: None, spec=spec)["rows"]
    finally:
        binding.SdpaRouter.checkpoint = real
    step = result["stand_in"]
    assert result["sdpa_default"]["status"] == "ok" and step["status"] == "ok", result
    assert step["routed_per_step"] == spec.calls(config) == 4 and step["routed_every_step"]
    assert recomputed and all(r.recomputed > 0 for r in recomputed)  # the backward's recompute went through the step
    assert abs(step["loss_diff"]) < 1e-2 and step["grad_cosine"] > 0.99, step
    plain = spec._replace(build=_torch_checkpointed)
    result = train.benchmark(config, spec.batch(config, (2, 8, 8), "cpu"), rows, warmup=0, iters=1, device="cpu",
                             log=lambda m: None, spec=plain)["rows"]
    status = result["stand_in"]["status"]  # (a status keeps its first 300 characters)
    assert status.startswith("failed") and binding.CHECKPOINTED[:120] in status, status


def _torch_checkpointed(config, device):
    """The Wan model with diffusers' own gradient checkpointing (torch's checkpoint, which the drop-in cannot follow)."""
    model = train.build_wan(config, device)
    model.enable_gradient_checkpointing()
    return model


def test_the_command_line():
    args = train.parse_args(["--quick"])
    assert (args.layers, args.tokens, args.grid, args.warmup, args.iters) == (2, 1024, (2, 16, 16), 1, 2)
    assert train.parse_args(["--model", "wan", "--grid", "1x4x4"]).grid == (1, 4, 4)
    with pytest.raises(SystemExit):
        train.parse_args(["--grid", "3x3x3"])  # not a multiple of the patch
    with pytest.raises(SystemExit):
        train.parse_args(["--report", "no/such/file.json"])
    with pytest.raises(SystemExit):
        train.parse_args(["--iters", "0"])


def test_the_wan_run_of_record_is_the_newest_with_checkpointing_where_there_is_one(tmp_path):
    """Issue 37 states the Wan training step's target with gradient checkpointing: a checkpointed run of record is
    shown over a newer one without it; without any, the newest is; Qwen's is the newest either way."""
    def write(name, checkpointing, key="wan", iters=5):
        model = {"key": key, "config": json.loads(json.dumps(train.MODELS[key].config)), "gradient_checkpointing": checkpointing}
        run = {"kind": "train", "model": model, "grid": list(train.GRID), "tokens": train.TOKENS, "timing": {"iters": iters},
               "name": name}
        (tmp_path / "results" / "h200").mkdir(parents=True, exist_ok=True)
        (tmp_path / "results" / "h200" / f"train-{key}-{name}.json").write_text(json.dumps(run))
    write("2026-12-01", False)
    assert train.newest_full_runs(tmp_path)["wan"]["name"] == "2026-12-01"
    write("2026-12-02", True)
    write("2026-12-03", False)
    write("2026-12-04", True, iters=2)  # not a run of record: too few steps
    assert train.newest_full_runs(tmp_path)["wan"]["name"] == "2026-12-02"
    write("2026-12-05", False, key="qwen")
    assert train.newest_full_runs(tmp_path)["qwen"]["name"] == "2026-12-05"
