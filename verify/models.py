"""The end-to-end harness for models: what python -m verify.capstone (verify/capstone.py), its context-parallel runs
(verify/cp.py) and python -m verify.prefill (verify/prefill.py) share.

The optional modules (diffusers, transformers: requirements-capstone.txt) and their versions; the capstone's model,
diffusers' WanTransformer3DModel with the Wan2.1-T2V-1.3B configuration and seeded random weights, and its inputs; the
attention backends a model runs with (SDPA's own, a step through its drop-in, FlashAttention-3 through a router of the
same class); timing whole forwards, comparing outputs, what a router decided; the results files and the README
sections generated from them. The command lines are in the modules named above; this one has none.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from verify import machine
from verify import steps as steps_mod

ROOT = steps_mod.ROOT
# Wan2.1-T2V-1.3B's transformer, as diffusers converts it: scripts/convert_wan_to_diffusers.py of the diffusers
# repository, model type "Wan-T2V-1.3B" (added_kv_proj_dim None: text-to-video, no image branch); rope_max_seq_len is
# WanTransformer3DModel's default, which that script leaves as it is.
WAN_T2V_1_3B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}
CONFIG_SOURCE = "diffusers scripts/convert_wan_to_diffusers.py, model type Wan-T2V-1.3B"
PATCH = WAN_T2V_1_3B["patch_size"]
TEXT_TOKENS = 512  # the pipeline pads every prompt to 512 text-encoder tokens (max_sequence_length)
SEED = 0
TIMESTEP = 500.0
SMOKE_ROOT = ROOT / "build" / "capstone"  # where the Wan model's smoke runs write (ignored by git: nothing to keep)


# ---------------------------------------------------------------- what this machine has

def need(name: str, prog: str | None = None):
    """Import an optional module, or stop with one line saying how to install it (`prog`: the command that needs it)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:  # not installed, or a dependency of it too old (a name it imports is missing)
        why = f"{e.name} is not installed" if e.name and str(e).startswith("No module named") else str(e).splitlines()[0]
        raise SystemExit(f"{prog + ': ' if prog else ''}error: cannot import {name} ({why}) in {sys.executable}: "
                         "pip install -r requirements-capstone.txt") from None


def versions() -> dict:
    """The versions of what the run used (read, never installed)."""
    import torch
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version()}
    for name in ("diffusers", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


# ---------------------------------------------------------------- the Wan2.1-T2V-1.3B denoiser and its inputs

def cast_like_from_pretrained(model, dtype):
    """model.to(dtype), except what diffusers keeps in float32 when it loads a checkpoint with torch_dtype=dtype: a
    parameter one of whose dotted name's parts is in the class's _keep_in_fp32_modules (norm1, rope, ...), the rule of
    diffusers' model loading. Buffers stay as the model made them (rope's tables: float32, as after from_pretrained)."""
    import torch
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    return model


def build_transformer(config: dict, device, seed: int = SEED):
    """WanTransformer3DModel(**config) with seeded random weights, made on `device` (fast: no CPU init), in bf16 but for
    the modules diffusers keeps in float32, in eval mode, without gradients."""
    import torch
    diffusers = need("diffusers")
    torch.manual_seed(seed)
    with torch.device(device):
        model = diffusers.WanTransformer3DModel(**config)
    return cast_like_from_pretrained(model, torch.bfloat16).eval().requires_grad_(False)


def tokens_of(grid, patch=PATCH) -> int:
    """The transformer's tokens for a latent grid: the grid in patches."""
    return math.prod(n // p for n, p in zip(grid, patch))


def parse_grid(text: str) -> tuple:
    """A latent grid 'FxHxW' (the latents' frames x height x width, each a multiple of the patch: height and width
    even) -> (F, H, W); ValueError where it is none."""
    dims = text.lower().split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims) or any(int(d) % p for d, p in zip(dims, PATCH)):
        raise ValueError(f"{text!r} is not a latent grid FxHxW whose sizes are multiples of the patch "
                         f"{'x'.join(map(str, PATCH))}")
    return tuple(int(d) for d in dims)


def parse_modes(text: str, modes: tuple) -> list[str]:
    """'eager,compile' -> the modes named (each of `modes`), in order, once each; ValueError for anything else."""
    named = [m.strip() for m in text.split(",") if m.strip()]
    if not named or any(m not in modes for m in named):
        raise ValueError(f"cannot read {text!r}: give {', '.join(modes)} or both, comma-separated")
    return list(dict.fromkeys(named))


def make_inputs(config: dict, grid, device, seed: int = SEED + 1) -> dict:
    """One denoiser forward's arguments: bf16 latents [1, channels, *grid], random text-encoder states of TEXT_TOKENS
    tokens, and a timestep."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    latents = torch.randn(1, config["in_channels"], *grid, generator=gen)
    text = torch.randn(1, TEXT_TOKENS, config["text_dim"], generator=gen)
    return {"hidden_states": latents.to(device, torch.bfloat16), "encoder_hidden_states": text.to(device, torch.bfloat16),
            "timestep": torch.tensor([TIMESTEP], device=device), "return_dict": False}


def attention_calls(config: dict) -> int:
    """SDPA calls of one forward: a self-attention and a cross-attention in every block."""
    return 2 * config["num_layers"]


# ---------------------------------------------------------------- the attention backends

class Backend(NamedTuple):
    name: str                     # the results' key: sdpa_default, sdpa_cudnn, sdpa_flash, step14, fa3
    label: str                    # as the tables show it
    context: Callable | None      # () -> a context manager active around compile and every forward; None: unavailable
    unavailable: str = ""         # why it is not run ("not installed (...)")
    source: str = ""              # where its kernel comes from, where that is worth saying (FA3's module)


def fa3_attention():
    """FlashAttention-3's forward as the drop-in's attention function (q, k, v, scale, causal=False) -> o, and where it
    came from; (None, why) where it does not import: the fa3-fwd package, loaded as verify's benchmark loads it.
    causal is always False here: FA3's limits (backends) have no features, so its router routes no causal call."""
    from verify.bench import fa3_attention as fa3_of_the_benchmark
    attention, why = fa3_of_the_benchmark()
    if attention is None:
        return None, why
    return (lambda q, k, v, scale, causal=False: attention(q, k, v, scale)[0]), "fa3-fwd (fa3_fwd_interface)"


def backends(step_mod, fa3=None) -> list[Backend]:
    """The rows of the benchmark. `fa3`: (attention function, where) from fa3_attention()."""
    import binding  # common/binding (on sys.path through verify.steps): the class every step's drop-in is made of
    from torch.nn.attention import SDPBackend, sdpa_kernel
    step = step_mod.info["step"]
    fa3_fn, fa3_where = fa3 if fa3 is not None else fa3_attention()
    # FA3 through the drop-in's router class: the same decision and counting as the step's, with FA3's limits (sm_90
    # only; bf16 and fp16, every head dim the binding names: FA3 takes them all).
    fa3_limits = binding.SdpaLimits("fa3", archs=("sm_90a",), features=binding.FEATURE_FP16, head_dims=binding.HEAD_DIMS)
    return [
        Backend("sdpa_default", "SDPA default", contextlib.nullcontext),
        Backend("sdpa_cudnn", "SDPA cuDNN", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
        Backend("sdpa_flash", "SDPA FLASH", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
        Backend(step, step, lambda: step_mod.sdpa(strict=True)),
        Backend("fa3", "FA3", (lambda: binding.SdpaRouter(fa3_fn, fa3_limits, strict=True, name="fa3.sdpa")) if fa3_fn else None,
                "" if fa3_fn else fa3_where, fa3_where if fa3_fn else ""),
    ]


def load_step(step: str):
    """Build (cached) and import the step as verify does (build/dev)."""
    steps_mod.build([step], jobs=os.cpu_count() or 2, log=lambda m: None)
    return steps_mod.load(step)


# ---------------------------------------------------------------- timing

def synchronize(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_forwards(forward: Callable, iters: int, device) -> list[float]:
    """Milliseconds of each of `iters` back-to-back calls of forward(): CUDA events on a GPU, the wall clock elsewhere."""
    import torch
    times = []
    for _ in range(iters):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            forward()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def agreement(out, ref) -> dict:
    """How close `out` is to `ref`: relative error ||out - ref|| / ||ref|| and cosine similarity, in float64."""
    import torch
    a, b = out.double().flatten(), ref.double().flatten()
    return {"rel_err": float((a - b).norm() / b.norm()), "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0))}


def counts_of(ctx) -> dict:
    """What a drop-in router decided (routed, fallbacks by reason); {} for the other backends' contexts. `routed` counts
    the calls routed again in a checkpoint's recompute too (binding.checkpoint: SdpaRouter.recomputed)."""
    if not hasattr(ctx, "routed"):
        return {}
    return {"routed": ctx.routed + getattr(ctx, "recomputed", 0), "fallbacks": dict(ctx.fallbacks)}


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_row(fn, args: dict, row: Backend, mode: str, warmup: int, iters: int, device, outputs: dict, tokens: int,
            where: str, log) -> dict:
    """One cell: the first call (under compile it compiles; the router's counts are its decisions), the warm-up
    forwards, the timed ones. Keeps the first call's output in outputs[mode, tokens, row.name]."""
    import torch
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            with row.context() as ctx:
                out = fn(**args)[0]
            synchronize(device)
            first_s = time.perf_counter() - t0
            log(f"{where}: first call {first_s:.1f} s{' (compile included)' if mode == 'compile' else ''}; "
                f"{warmup} warm-up + {iters} timed forwards")
            with row.context():  # a new context of the same kind: no recompile (SdpaRouter.key)
                for _ in range(warmup):
                    fn(**args)
                synchronize(device)
                times = time_forwards(lambda: fn(**args), iters, device)
    except Exception as e:  # noqa: BLE001  (one backend that fails, e.g. a missing kernel, is a row that says so)
        log(f"{where}: failed: {first_line(e)}")
        return {"status": f"failed: {first_line(e)}"}
    cell = {"status": "ok", "ms": statistics.median(times), "times_ms": times, "first_s": first_s, **counts_of(ctx),
            "finite": bool(torch.isfinite(out).all())}
    outputs[mode, tokens, row.name] = out
    log(f"{where}: {cell['ms']:.1f} ms (median of {iters})"
        + (f"; {cell['routed']} routed, {sum(cell['fallbacks'].values())} fell back" if "routed" in cell else ""))
    return cell


# ---------------------------------------------------------------- a whole model timed with each backend
# (python -m verify.capstone's Wan and python -m verify.cogvideox's CogVideoX: the loop, its speedups, tables and chart)

@contextlib.contextmanager
def compiled(model, mode: str, scope: str, backend: str, fullgraph: bool):
    """What a row runs: the model itself in eager; under compile, a fresh torch.compile of the whole model (scope
    "model"), or of each transformer block (scope "blocks": diffusers' regional compilation, the blocks sharing one
    compiled graph; the rest of the model runs eagerly), put back as they were afterwards."""
    import torch
    if mode == "eager":
        yield model
        return
    options = dict(backend=backend, fullgraph=fullgraph, dynamic=False)
    # Inductor's caches key a graph by its code, not by the SDPA backend that sdpa_kernel() forces while it is traced:
    # with them on, a row compiled after SDPA's default got the default's compiled graph back (the run of 2026-12-01:
    # SDPA FLASH's first call 1.2 s, its output the default's bit for bit). Off, each row is compiled for itself.
    with torch._inductor.config.patch(force_disable_caches=True):
        if scope == "model":
            yield torch.compile(model, **options)
            return
        name = "blocks" if hasattr(model, "blocks") else "transformer_blocks"  # Wan's, CogVideoX's
        blocks = getattr(model, name)
        setattr(model, name, torch.nn.ModuleList([torch.compile(block, **options) for block in blocks]))
        try:
            yield model
        finally:
            setattr(model, name, blocks)


def benchmark(model, config: dict, shapes: list, modes: list, rows: list[Backend], *, warmup: int, iters: int, device,
              compile_backend: str = "inductor", compile_scope: str = "model", fullgraph: bool = True, log=print,
              inputs: dict | None = None) -> dict:
    """Time one forward of `model` per shape, mode and backend. Returns {"runs": {mode: {tokens: {backend: cell}}}}.
    `inputs`: {tokens: the forward's arguments} of another model than Wan's (verify/cogvideox.py); `shapes` then unused.

    A cell: "ms" (median), "times_ms", "first_s" (the first call, the compile included), the router's counts of one
    forward ("routed", "fallbacks": in eager one forward's calls, under compile the calls it traced), "rel_err" and
    "cosine" against SDPA's default, and "status": "ok", "not installed", or "failed: <why>".
    """
    import torch
    inputs = inputs if inputs is not None else {tokens_of(g): make_inputs(config, g, device) for g in shapes}
    todo = [(m, r) for m in modes for r in rows]
    runs: dict = {m: {str(t): {} for t in inputs} for m in modes}
    outputs: dict = {}
    for i, (mode, row) in enumerate(todo, 1):
        if row.context is None:
            for t in inputs:
                runs[mode][str(t)][row.name] = {"status": row.unavailable}
            log(f"[{i}/{len(todo)}] {mode} {row.label}: {row.unavailable}")
            continue
        torch._dynamo.reset()  # a fresh compile for each backend: what was traced for another one is not reused
        with compiled(model, mode, compile_scope, compile_backend, fullgraph) as fn:
            for tokens, args in inputs.items():
                runs[mode][str(tokens)][row.name] = run_row(fn, args, row, mode, warmup, iters, device, outputs, tokens,
                                                            f"[{i}/{len(todo)}] {mode} {row.label} at {tokens} tokens", log)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    for (mode, tokens, name), out in outputs.items():  # every output against SDPA's default of its mode and shape
        ref = outputs.get((mode, tokens, "sdpa_default"))
        if ref is not None:
            runs[mode][str(tokens)][name].update(agreement(out, ref))
    torch._dynamo.reset()
    return {"runs": runs}


def speedups(runs: dict) -> dict:
    """{mode: {tokens: {backend: SDPA default's ms / its ms}}}, for the cells that ran."""
    out: dict = {}
    for mode, by_tokens in runs.items():
        for tokens, cells in by_tokens.items():
            base = cells.get("sdpa_default", {}).get("ms")
            out.setdefault(mode, {})[tokens] = {name: base / c["ms"] for name, c in cells.items() if c.get("ms") and base}
    return out


def write_results_and_chart(run: dict, json_path: Path, out: Path | None = None, log=print) -> Path:
    """write_results, and the run's chart beside it (a .png of the same stem)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(run, indent=1, default=str))
    chart(run, json_path.with_suffix(".png"))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        for p in (json_path, json_path.with_suffix(".png")):
            shutil.copyfile(p, out / p.name)
    log(f"wrote {json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path} and its .png"
        + (f" (copies in {out})" if out else ""))
    return json_path


def ms_text(x) -> str:
    """A time in ms as the tables write it: no decimals from 100 ms up, one below."""
    return f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms"


def grid_label(run: dict, tokens: str) -> str:
    grid = run["shapes"].get(tokens)
    return f"{tokens} ({'×'.join(map(str, grid))})" if grid else tokens


def backend_labels(run: dict) -> dict:
    return {name: label for name, label in run["backends"]}


def times_table(run: dict, mode: str) -> str:
    """| tokens (latent grid) | each backend: ms (× SDPA default) |, one row per shape."""
    labels = backend_labels(run)
    lines = [f"| {mode}: tokens (latent grid) | " + " | ".join(labels.values()) + " |",
             "|---|" + "---:|" * len(labels)]
    for tokens, cells in run["runs"][mode].items():
        parts = []
        for name in labels:
            c = cells.get(name, {})
            sp = run["speedup_vs_sdpa_default"].get(mode, {}).get(tokens, {}).get(name)
            parts.append(f"{ms_text(c['ms'])} ({sp:.3f}×)" if c.get("ms") and sp else short_status(c))
        lines.append(f"| {grid_label(run, tokens)} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def agreement_table(run: dict) -> str:
    """Every output against SDPA's default: relative error, cosine, and the error as a multiple of SDPA FLASH's own."""
    labels = {k: v for k, v in backend_labels(run).items() if k != "sdpa_default"}
    lines = ["| agreement with SDPA default: mode, tokens | " + " | ".join(labels.values()) + " |",
             "|---|" + "---:|" * len(labels)]
    for mode in run["modes"]:
        for tokens, cells in run["runs"][mode].items():
            flash = cells.get("sdpa_flash", {}).get("rel_err")
            parts = []
            for name in labels:
                c = cells.get(name, {})
                if "rel_err" not in c:
                    parts.append("-")
                    continue
                vs = f", {c['rel_err'] / flash:.2f}× FLASH's" if flash and name != "sdpa_flash" else ""
                parts.append(f"{c['rel_err']:.2e} / {c['cosine']:.6f}{vs}")
            lines.append(f"| {mode}, {tokens} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def counts_note(run: dict) -> str:
    """What the drop-in routers decided in one eager forward, per backend that has one (under compile they decide while
    tracing: the counts of the traced calls are in the results file)."""
    parts = []
    for name, label in run["backends"]:
        seen = [(m, t, c) for m in run["modes"] if m == "eager"
                for t, cells in run["runs"][m].items() if "routed" in (c := cells.get(name, {}))]
        if not seen:
            continue
        routed = sorted({c["routed"] for _, _, c in seen})
        fell = sorted({sum(c["fallbacks"].values()) for _, _, c in seen})
        parts.append(f"{label}: {'/'.join(map(str, routed))} of {run['attention_calls']} attention calls routed per eager forward"
                     + (f", {'/'.join(map(str, fell))} fell back" if fell != [0] else ""))
    return "; ".join(parts)


def chart(run: dict, path: Path) -> None:
    """One panel per mode: each backend's end-to-end ms per shape, its speedup against SDPA's default written on it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = backend_labels(run)
    modes = run["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.6), dpi=120, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        by_tokens = run["runs"][mode]
        width = 0.8 / max(1, len(by_tokens))
        for j, (tokens, cells) in enumerate(by_tokens.items()):
            xs = [i + (j - (len(by_tokens) - 1) / 2) * width for i in range(len(labels))]
            ms = [cells.get(name, {}).get("ms") or 0 for name in labels]
            bars = ax.bar(xs, ms, width, label=grid_label(run, tokens), color=plt.get_cmap("viridis")(j / max(1, len(by_tokens) - 1)))
            for bar, name in zip(bars, labels):
                sp = run["speedup_vs_sdpa_default"].get(mode, {}).get(tokens, {}).get(name)
                text = f"{sp:.2f}×" if sp else short_status(cells.get(name, {}))
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=7,
                        rotation=0 if sp else 90)
        ax.set_xticks(range(len(labels)), list(labels.values()), rotation=20, ha="right")
        ax.set_ylabel("ms per denoiser forward (lower is better)")
        ax.set_title(f"{mode}: {run['model'].get('title', 'Wan2.1-T2V-1.3B denoiser, bf16')}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, title="tokens (latent grid)", title_fontsize=8)
    fig.suptitle(f"flashladder capstone on {run['meta']['gpu']} (× = speedup against SDPA default, same mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def console_summary(run: dict) -> str:
    return "\n\n".join([times_table(run, mode) for mode in run["modes"]] + [agreement_table(run), counts_note(run)])


# ---------------------------------------------------------------- the results files and the README sections

def results_path(kind: str, gpu: str, root: Path = ROOT, stamp: str | None = None) -> Path:
    """results/<gpu>/<kind>-<timestamp>.json under `root` (a smoke run's root: build/<kind>/, which git ignores)."""
    return root / "results" / machine.results_folder(gpu) / f"{kind}-{stamp or machine.utc_stamp()}.json"


def gpu_meta(device) -> dict:
    """What a model run records of its machine: the GPU, the driver and its clocks now (nvidia-smi, read only), the versions."""
    import torch
    meta = versions()
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=props.name, sm=f"sm_{props.major}{props.minor}", cudnn=torch.backends.cudnn.version(), **machine.smi())
    else:
        meta.update(gpu=f"no GPU ({platform.processor() or platform.machine()})")
    nn_attention = importlib.import_module("torch.nn.attention")  # what this torch offers for SDPA providers (issue 16)
    meta["torch_flash_attention_impls"] = (nn_attention.list_flash_attention_impls()
                                           if hasattr(nn_attention, "list_flash_attention_impls") else None)
    return meta


def short_status(cell: dict) -> str:
    """'not installed', 'failed', '-': a cell without a time, in a word or two (the results file has the why)."""
    return (cell.get("status") or "-").split(":")[0].split(" (")[0]


def newest_run(pattern: str, accept, root: Path = ROOT) -> dict | None:
    """The newest results file under `root` matching the glob `pattern` (by name: the names are timestamps) whose run
    `accept` takes, read; None where there is none. The capstone's and the prefill's run of record."""
    runs = [json.loads(p.read_text()) for p in sorted(root.glob(pattern), key=lambda p: p.name)]
    accepted = [r for r in runs if accept(r)]
    return accepted[-1] if accepted else None


# The page that holds the capstone's and the prefill's generated sections.
MODELS_PAGE = ROOT / "docs" / "capstone.md"


def write_readme_section(readme: Path, begin: str, end: str, text: str) -> bool:
    """The page's section between the markers `begin` and `end` replaced by `text` (written for the repository's root:
    in a page under docs/ its links to results/ become ../results/); False (nothing written) where the page has no
    such markers."""
    from verify.report import replace_between
    if readme.resolve().parent.name == "docs":
        text = text.replace("](results/", "](../results/")
    new = replace_between(readme.read_text(), begin, end, text)
    if new is None:
        return False
    readme.write_text(new)
    return True


def arg_type(parse):
    """An argparse type of `parse` (text -> value, ValueError with the reason): the reason becomes argparse's one line."""
    import argparse

    def wrapped(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return wrapped


# ---------------------------------------------------------------- shared by the command lines

@contextlib.contextmanager
def default_dtype(dtype):
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def at_least(least, kind=int):
    """argparse type: a number (int or float) of at least `least`, or a one-line error."""
    import argparse

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {text!r} as a{'n integer' if kind is int else ' number'}") from None
        if not value >= least:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {text}")
        return value
    return parse


def write_results(run: dict, json_path: Path, out: Path | None = None, log=print) -> Path:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(run, indent=1, default=str))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(json_path, out / json_path.name)
    log(f"wrote {json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path}"
        + (f" (a copy in {out})" if out else ""))
    return json_path
