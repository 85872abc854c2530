"""CPU: the context-parallel capstone's parts (verify/cp.py).

The ring's arithmetic: merge_partials of partial attentions over 2 and 3 key shards against the float64 reference
(verify/reference.py), causal or not, with rows that see no key in some shards or in all; shard_causal's table and
sharded_attention, a ring's shards for one rank's queries, with the diagonal each shard needs. The ring drop-in
(CudnnRouter) with a stand-in op (plain torch attention on CPU, verify/tests/test_sdpa_router.py): the calls of
aten._scaled_dot_product_cudnn_attention it takes, answered in that op's result format (as its meta kernel makes it,
and as diffusers' own cuDNN forward op reads it), the calls it leaves to torch and why, strict mode, SDPA calls beside
them. diffusers' context parallelism itself, in two processes over gloo: a tiny Wan model under Ulysses (the SDPA
drop-in) and ring (the ring drop-in), against the one-process run; the entry's run (verify.cp._run) under Ulysses, its
results file. The command line's errors, each in one line.
"""
import importlib
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from verify import capstone, cp, models  # noqa: E402
from verify.reference import attention_reference, attention_reference_of, causal_mask  # noqa: E402
from verify.tests.test_capstone import optional  # noqa: E402
from verify.tests.test_sdpa_router import (  # noqa: E402
    CPU_CAUSAL_LIMITS,
    CPU_LIMITS,
    binding,
    cpu_qkv,
    stand_in,
    stand_in_attention,
)

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16
SCALE = 1 / math.sqrt(128)


@pytest.fixture(scope="module")
def diffusers():
    optional("transformers")
    return optional("diffusers")


def inputs64(b, h, nq, nk, factor=1.0, seed=0):
    gen = np.random.default_rng(seed)
    return tuple(factor * (gen.standard_normal((b, h, n, 128)) + 0.5) for n in (nq, nk, nk))


def stand_in_lse(q, k, v, scale=None, causal=False):
    """The stand-in op as a step's `attention`: (q, k, v, scale, causal) -> (o, lse)."""
    return stand_in(q, k, v, SCALE if scale is None else scale, binding.check_causal("stand_in", causal, binding.FEATURE_CAUSAL))


def reference_attention(q, k, v, scale=None, causal=False):
    """The float64 reference as a step's `attention` (torch tensors in and out)."""
    o, lse = attention_reference_of(*(t.double().numpy() for t in (q, k, v)), scale, causal)
    return torch.from_numpy(o), torch.from_numpy(lse)


def ring_router(strict=False, limits=CPU_LIMITS, attention=stand_in_lse):
    return cp.make_ring_router(binding, attention, limits, strict, name="stand_in.ring_sdpa")


def assert_close_to_reference(o, lse, o_ref, lse_ref, o_atol=None, lse_atol=None, ulps=8):
    """o, lse against the float64 reference: the rows with no key exactly (o = 0, lse = -inf), the others within the
    given tolerances, by default those of a float32 merge: `ulps` float32 ulps of the largest |LSE| in each weight
    exp(lse_i - max), so as many of the largest |O| in o (inputs x10 make |LSE| ~ 800, where an ulp is 6e-5)."""
    o, lse = o.double().numpy(), lse.double().numpy()
    keyless = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), keyless), "the rows with no key differ"
    assert (o[keyless] == 0).all(), "a row with no key has o != 0"
    lse_scale = max(1.0, float(np.abs(lse_ref[~keyless]).max(initial=0.0)))
    lse_atol = ulps * 2.0**-23 * lse_scale if lse_atol is None else lse_atol
    o_atol = lse_atol * max(1.0, float(np.abs(o_ref).max())) if o_atol is None else o_atol
    np.testing.assert_allclose(o, o_ref, atol=o_atol, rtol=0)
    np.testing.assert_allclose(lse[~keyless], lse_ref[~keyless], atol=lse_atol, rtol=0)


# ---------------------------------------------------------------- merge_partials against the float64 reference

# (nq, nk, causal, shard sizes): every key of a row in one shard, a row's keys over several, rows that see no key of a
# shard (causal: the first rows see only the first keys), rows that see no key in any shard (bottom right, nq > nk).
MERGES = [
    (37, 53, False, (20, 33)),
    (37, 53, False, (10, 30, 13)),
    (40, 40, "top_left", (20, 20)),        # a square ring of two: shard 1 is past row < 20's diagonal
    (40, 60, "top_left", (7, 25, 28)),     # the last shard: no row sees it (top left: row i sees keys 0..i < 40)
    (30, 70, "bottom_right", (35, 35)),    # a KV cache: every row sees shard 0 whole
    (50, 30, "bottom_right", (10, 10, 10)),  # 20 rows see no key at all; rows 20..29 see keys of shard 0 alone
    (16, 16, "bottom_right", (1, 14, 1)),  # a shard of one key
]


@pytest.mark.parametrize("nq, nk, causal, sizes", MERGES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
def test_partials_merge_into_the_whole_call(nq, nk, causal, sizes, factor):
    """Exact float64 partials (the reference over each shard's keys, the call's mask cut to them), merged in float32:
    the float64 reference of the whole call, to float32's precision; rows with no key anywhere o = 0, lse = -inf."""
    q, k, v = inputs64(2, 3, nq, nk, factor)
    mask = causal_mask(nq, nk, causal) if causal else np.zeros((nq, nk))
    parts, start = [], 0
    for n in sizes:
        o_i, lse_i = attention_reference(q, k[:, :, start:start + n], v[:, :, start:start + n], SCALE, mask[:, start:start + n])
        parts.append((torch.from_numpy(o_i), torch.from_numpy(lse_i)))
        start += n
    o, lse = cp.merge_partials(parts)
    assert o.dtype == torch.float64 and lse.dtype == torch.float32  # o in the parts' dtype, computed in float32
    o_ref, lse_ref = attention_reference_of(q, k, v, SCALE, causal)
    assert_close_to_reference(o, lse, o_ref, lse_ref)
    # the causal cases but the KV cache's hold rows that see no key of some shard
    assert any(np.isneginf(p[1].numpy()).any() for p in parts) == (causal is not False and (nq, nk) != (30, 70))


def test_a_merge_is_shifted_so_that_large_lse_do_not_overflow():
    """LSE of 1e4 (exp would overflow any float) and of -1e4 (underflow): the merge shifts by each row's largest."""
    o1, o2 = torch.full((1, 1, 2, 4), 1.0), torch.full((1, 1, 2, 4), 3.0)
    for base in (1e4, -1e4):
        lse1, lse2 = torch.full((1, 1, 2), base), torch.full((1, 1, 2), base + math.log(3))  # weights 1 : 3
        o, lse = cp.merge_partials([(o1, lse1), (o2, lse2)])
        assert torch.allclose(o, torch.full_like(o, 2.5)) and torch.allclose(lse, torch.full_like(lse, base + math.log(4)))


def test_a_part_without_keys_for_a_row_is_not_read_there():
    """Where a part's lse is -inf its o may be anything (a NaN of 0/0): the merge does not read it."""
    o1, lse1 = torch.full((1, 1, 3, 4), math.nan), torch.tensor([[[-math.inf, -math.inf, 0.0]]])
    o1[..., 2, :] = 5.0
    o2, lse2 = torch.ones(1, 1, 3, 4), torch.tensor([[[0.0, -math.inf, -math.inf]]])
    o, lse = cp.merge_partials([(o1, lse1), (o2, lse2)])
    assert torch.equal(o[0, 0], torch.tensor([[1.0] * 4, [0.0] * 4, [5.0] * 4]))
    assert lse[0, 0, 0] == 0 and torch.isneginf(lse[0, 0, 1]) and lse[0, 0, 2] == 0


def test_a_merge_of_one_part_is_that_part_and_bad_parts_are_refused():
    o, lse = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5)
    merged_o, merged_lse = cp.merge_partials([(o.to(BF16), lse)])
    assert merged_o.dtype == BF16 and torch.equal(merged_o, o.to(BF16)) and torch.allclose(merged_lse, lse)
    assert cp.merge_partials([(o, lse)], dtype=torch.float32)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="no partial results"):
        cp.merge_partials([])
    with pytest.raises(ValueError, match="every part must be"):
        cp.merge_partials([(o, lse), (o[:, :, :4], lse[:, :, :4])])
    with pytest.raises(ValueError, match="every part must be"):
        cp.merge_partials([(o, lse.unsqueeze(-1))])  # cuDNN's [B, H, N, 1]: squeeze it first


# ---------------------------------------------------------------- a ring's shards: shard_causal and sharded_attention

def test_each_shard_of_a_causal_ring_gets_the_diagonal_it_needs():
    n = 64  # a square ring: rank r's queries are rows [r n, (r + 1) n), shard s the keys [s n, (s + 1) n)
    for r in range(3):
        for s in range(3):
            got = cp.shard_causal(n, s * n, n, r * n)  # top left over the whole sequence: row r n + i sees keys 0..r n + i
            assert got == (False if s < r else "top_left" if s == r else cp.SKIP), (r, s, got)
    # a KV cache, bottom right (offset nk - nq = 700): a shard before the last keys whole, the last one bottom right
    assert cp.shard_causal(300, 0, 600, 700) is False and cp.shard_causal(300, 600, 400, 700) == "bottom_right"
    assert cp.shard_causal(300, 650, 350, 700) == "bottom_right"  # any last shard
    assert cp.shard_causal(300, 600, 200, 700) is None  # a middle one: rows see 101 + i of its keys, a diagonal of neither
    assert cp.shard_causal(50, 0, 15, -20) is None  # bottom right, nq > nk: only the whole key set has the step's diagonal
    assert cp.shard_causal(10, 0, 0, 5) == cp.SKIP and cp.shard_causal(0, 0, 10, 5) == cp.SKIP


SHARDED = [
    (32, 96, False, (32, 32, 32)),
    (32, 96, "top_left", (32, 32, 32)),       # rank 0 of a ring of 3: its own shard top left, the others skipped
    (32, 64, "bottom_right", (32, 32)),       # rank 1 of 2: shard 0 whole, its own shard on the diagonal
    (32, 96, "bottom_right", (32, 32, 32)),   # rank 2 of 3
    (300, 1000, "bottom_right", (600, 400)),  # a KV cache over two unequal shards
    (50, 30, "bottom_right", (30,)),          # one shard whose first 20 rows see no key (the stand-in's o: NaN there)
]


@pytest.mark.parametrize("nq, nk, causal, sizes", SHARDED, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_sharded_attention_is_the_whole_call(nq, nk, causal, sizes):
    """A ring's partial calls, each with its shard's diagonal, merged: the whole call. With the float64 reference as the
    attention (the merge's float32 alone), and with the stand-in op (float32 scores, bf16 o: o rounded twice)."""
    q, k, v = (torch.from_numpy(x) for x in inputs64(1, 2, nq, nk))
    o_ref, lse_ref = attention_reference_of(q.numpy(), k.numpy(), v.numpy(), SCALE, causal)
    o, lse = cp.sharded_attention(reference_attention, q, k, v, sizes, SCALE, causal)
    assert_close_to_reference(o, lse, o_ref, lse_ref)
    o, lse = cp.sharded_attention(stand_in_lse, *(t.to(BF16) for t in (q, k, v)), sizes, SCALE, causal)
    assert o.dtype == BF16
    o_ref, lse_ref = attention_reference_of(*(t.to(BF16).double().numpy() for t in (q, k, v)), SCALE, causal)
    assert_close_to_reference(o, lse, o_ref, lse_ref, o_atol=2e-2, lse_atol=1e-4)


def test_sharded_attention_refuses_a_split_it_cannot_compute():
    q, k, v = cpu_qkv(n=300, nk=1000)
    with pytest.raises(ValueError, match="neither top left nor bottom right"):
        cp.sharded_attention(stand_in_lse, q, k, v, (600, 200, 200), causal="bottom_right")
    with pytest.raises(ValueError, match="do not split 1000 keys"):
        cp.sharded_attention(stand_in_lse, q, k, v, (500, 400))


# ---------------------------------------------------------------- the ring drop-in: aten's cuDNN op

def same_format(ours, torchs):
    """Field by field: both None, equal ints, or tensors of one shape and dtype."""
    assert len(ours) == len(torchs) == 9
    for i, (a, b) in enumerate(zip(ours, torchs)):
        if b is None or isinstance(b, int):
            assert a == b, (i, a, b)
        else:
            assert isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, (i, a, b)


def test_the_ring_drop_in_answers_the_cudnn_op_in_its_own_format():
    """Positional, keyword and .default calls: routed to the stand-in, the result as the op's meta kernel makes it
    (LSE [B, H, N, 1] on this torch), its O and LSE the stand-in's."""
    q, k, v = cpu_qkv(n=40, nk=24)
    op = cp.cudnn_op()
    with ring_router() as r:
        results = [op(q, k, v, None, True),
                   op(query=q, key=k, value=v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False,
                      return_debug_mask=False, scale=0.3),
                   op.default(q, k, v, None, False, scale=0.3)]
    assert r.routed == 3 and not r.fallbacks
    as_meta = op(*(t.to("meta") for t in (q, k, v)), None, True)
    for res, scale in zip(results, (SCALE, 0.3, 0.3)):
        same_format(res, as_meta)
        o, lse = stand_in(q, k, v, scale, 0)
        assert torch.equal(res[0], o) and torch.equal(res[1].squeeze(-1), lse)
    assert cp.cudnn_lse_has_trailing_dim() == (as_meta[1].dim() == 4)


def test_is_causal_goes_to_a_causal_step_as_top_left():
    """With equal lengths (unequal ones fall back: FALLS_BACK), where both corners are one."""
    q, k, v = cpu_qkv(n=40, nk=40)
    with ring_router(limits=CPU_CAUSAL_LIMITS) as r:
        res = cp.cudnn_op()(q, k, v, None, True, is_causal=True)
    assert r.routed == 1
    o, lse = stand_in(q, k, v, SCALE, binding.CAUSAL["top_left"])
    assert torch.equal(res[0], o) and torch.equal(res[1].squeeze(-1), lse)


def test_diffusers_cudnn_forward_op_reads_the_step_s_output_and_lse(diffusers):
    """diffusers' own forward op of its `_native_cudnn` backend (what its ring attention calls per K/V shard), under
    the drop-in: it gets the stand-in's O and LSE, in its model layout [B, S, H, D] and [B, S, H]."""
    _cudnn_attention_forward_op = importlib.import_module("diffusers.models.attention_dispatch")._cudnn_attention_forward_op
    q, k, v = (t.transpose(1, 2).contiguous() for t in cpu_qkv(b=2, h=3, n=40, nk=24))  # [B, S, H, D]
    ctx = types.SimpleNamespace()
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved", saved)
    with ring_router(strict=True) as r, torch.no_grad():
        out, lse = _cudnn_attention_forward_op(ctx, q, k, v, return_lse=True)
    assert r.routed == 1 and out.shape == q.shape and lse.shape == q.shape[:3]
    o_ref, lse_ref = stand_in(*(t.transpose(1, 2) for t in (q, k, v)), SCALE, 0)
    assert torch.equal(out, o_ref.transpose(1, 2)) and torch.equal(lse, lse_ref.transpose(1, 2))


FALLS_BACK = {
    "attn_bias": (lambda q, k, v: ((q, k, v, torch.zeros(40, 24, dtype=BF16), True), {}),
                  "attn_bias is given: the ring drop-in takes the cuDNN op without a bias"),
    "causal bias": (lambda q, k, v: ((q, k, v, torch.nn.attention.bias.causal_lower_right(40, 24), True), {}),
                    "attn_bias is given: the ring drop-in takes the cuDNN op without a bias"),
    "is_causal, unequal lengths": (lambda q, k, v: ((q, k, v, None, True), {"is_causal": True}),
                                   "is_causal with seqlen_q != seqlen_k: which corner the cuDNN op means there is unchecked"),
    "dropout": (lambda q, k, v: ((q, k, v, None, True, 0.1), {}), "dropout_p=0.1: the step has no dropout"),
    "is_causal, non-causal step": (lambda q, k, v: ((q, q.clone(), q.clone(), None, True), {"is_causal": True}),  # equal lengths
                                   "is_causal=True: the step is non-causal"),
    "debug mask": (lambda q, k, v: ((q, k, v, None, True), {"return_debug_mask": True}),
                   "return_debug_mask=True: the step returns no attention matrix"),
    "fp16": (lambda q, k, v: ((q.half(), k.half(), v.half(), None, True), {}),
             "q has dtype torch.float16; this step computes in torch.bfloat16 only (fp16: step40 on)"),
    "head dim 64": (lambda q, k, v: ((q[..., :64], k[..., :64], v[..., :64], None, True), {}),
                    "q has head dim 64 (shape (1, 2, 40, 64)); this step takes 128 (64: step41 on)"),
    "heads differ": (lambda q, k, v: ((q, k[:, :1], v[:, :1], None, True), {}), "2 query heads and 1 key/value heads without enable_gqa"),
    "unknown argument": (lambda q, k, v: ((q, k, v, None, True), {"window": 3}),
                         "the arguments do not bind to the cuDNN attention op's parameters"),
}


@pytest.mark.parametrize("case", FALLS_BACK)
def test_what_the_ring_drop_in_leaves_to_torch(case):
    """Each such call goes to torch as it is (on CPU torch's op has no kernel, and says so), counted with its reason."""
    make, reason = FALLS_BACK[case]
    args, kwargs = make(*cpu_qkv(n=40, nk=24))
    with ring_router() as r, pytest.raises((NotImplementedError, RuntimeError, TypeError)) as raised:
        cp.cudnn_op()(*args, **kwargs)
    assert r.routed == 0 and list(r.fallbacks) == [next(x for x in r.fallbacks)] and next(iter(r.fallbacks)).startswith(reason)
    assert "stand_in" not in str(raised.value)


def test_a_call_left_to_torch_gets_torch_s_own_result():
    """On meta tensors (which this stand-in does not take) torch's meta kernel answers: the call reached torch unchanged."""
    q, k, v = (t.to("meta") for t in cpu_qkv(n=40, nk=24))
    with ring_router() as r:
        res = cp.cudnn_op()(q, k, v, None, True, 0.0, False, False, scale=0.3)
    assert r.fallbacks == {"the tensors are on meta; the step runs on cpu tensors": 1}
    same_format(res, cp.cudnn_op()(q, k, v, None, True))


def test_needing_gradients_falls_back_and_strict_raises():
    q, k, v = (t.requires_grad_() for t in cpu_qkv(n=40, nk=24, dtype=torch.float32))
    q, k, v = (t.to(BF16) for t in (q, k, v))
    with ring_router() as r, pytest.raises(NotImplementedError):
        cp.cudnn_op()(q, k, v, None, True)
    assert list(r.fallbacks) == ["gradients are needed: the step computes no backward (run the model under torch.no_grad())"]
    with ring_router(strict=True), pytest.raises(binding.NotRouted, match=r"stand_in.ring_sdpa\(strict=True\): a cuDNN attention "
                                                 r"call \(aten._scaled_dot_product_cudnn_attention\) would fall back to torch: dropout"):
        cp.cudnn_op()(*cpu_qkv(n=40, nk=24), None, True, 0.1)


def test_the_ring_drop_in_is_the_sdpa_drop_in_too():
    """The SDPA calls (Wan's cross-attention under diffusers' _native_cudnn backend is one, not split) are routed as the
    step's sdpa() routes them and counted with the cuDNN op's; other torch calls pass unchanged."""
    q, k, v = cpu_qkv(n=40, nk=24)
    with ring_router() as r:
        o = F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(40, 24, dtype=BF16))
        cp.cudnn_op()(q, k, v, None, True)
        assert torch.equal(torch.add(q, 1), q + 1)
    assert r.routed == 2 and r.fallbacks == {"attn_mask is given: the step takes no mask": 1}
    assert torch.equal(o, stand_in_attention(q, k, v, SCALE))


# ---------------------------------------------------------------- diffusers' context parallelism, two processes over gloo

def tiny_config(layers=2):
    """test_capstone.py's tiny Wan model: head dim 128, 2 heads (Ulysses over 2 ranks: one head each)."""
    return {**capstone.WAN_T2V_1_3B, "num_attention_heads": 2, "text_dim": 64, "freq_dim": 32, "ffn_dim": 64, "num_layers": layers}


GRID = (2, 8, 8)  # 32 tokens: 16 a rank


def stand_in_step():
    """What verify.cp needs of a step module, the stand-in op behind it (it takes CPU tensors)."""
    return types.SimpleNamespace(
        __name__="stand_in", info={"step": "stand_in"}, attention=stand_in_lse,
        sdpa=lambda strict=False: binding.SdpaRouter(stand_in_attention, CPU_LIMITS, strict, name="stand_in.sdpa"))


WRONG_CALLS = []


def wrong_lse(q, k, v, scale=None, causal=False):
    """The right O, and every other call (a ring of two: one of a block's two shards) an LSE 30 too small: that shard
    then weighs e^-30 in the merge, as if its keys were not there."""
    o, lse = stand_in_lse(q, k, v, scale, causal)
    WRONG_CALLS.append(1)
    return o, lse - 30.0 * (len(WRONG_CALLS) % 2)


def _worker(rank: int, world: int, init: str, out: str) -> None:
    """One rank: the entry's run (Ulysses), then a tiny model under each kind of context parallelism and drop-in."""
    import torch.distributed as dist
    # diffusers takes each rank's device as rank % torch.accelerator.device_count(), which is 0 on a machine without
    # an accelerator; here the one device is the CPU (nothing of diffusers is changed)
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        step = stand_in_step()
        args = types.SimpleNamespace(cp="ulysses", shapes=[GRID], warmup=1, iters=2, quick=False, out=None)
        rc = cp._run(args, rank, world, "cpu", dist, lambda m: None, step_mod=step, config=tiny_config(), root=Path(out))
        x = models.make_inputs(tiny_config(), GRID, "cpu")
        got = {"rc": rc}
        # Ulysses first: the ring model sets diffusers' active backend to _native_cudnn, which a later model would take
        for name, mode, router in (
                ("ulysses", "ulysses", lambda: step.sdpa(strict=True)),
                ("ring", "ring", lambda: cp.ring_sdpa(step, strict=True)),
                ("ring_wrong_lse", "ring", lambda: cp.make_ring_router(binding, wrong_lse, CPU_LIMITS, True, name="wrong"))):
            model = cp.parallel_transformer(tiny_config(), "cpu", mode, world)
            hook = model.blocks[0].attn1.register_forward_hook(lambda m, i, o, name=name: got.__setitem__(name + "_attn1", o))
            with torch.no_grad(), router() as r:
                got[name] = model(**x)[0]
            hook.remove()
            got[name + "_counts"] = (r.routed, dict(r.fallbacks))
        torch.save(got, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(diffusers, tmp_path_factory):
    """Two processes (spawned), a gloo group; each rank's results and the one-process outputs to hold them against."""
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("cp")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, 2, f"file://{out / 'rendezvous'}", str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.terminate()
    assert all(p.exitcode == 0 for p in procs), f"a rank failed or hung: exit codes {[p.exitcode for p in procs]}"
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    model = capstone.build_transformer(tiny_config(), "cpu")
    x = models.make_inputs(tiny_config(), GRID, "cpu")
    attn1 = []
    with torch.no_grad():
        plain = model(**x)[0]
        model.blocks[0].attn1.register_forward_hook(lambda m, i, o: attn1.append(o))
        with stand_in_step().sdpa(strict=True):
            routed = model(**x)[0]
    return ranks, plain, routed, out, attn1[0]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_context_parallelism_with_the_drop_in_is_the_one_process_model(two_ranks, mode):
    """Every attention call routed on each rank (Ulysses: the self- and the cross-attention of each block, one SDPA call
    each; ring: one cuDNN op call per K/V shard and the cross-attention's SDPA call), and the output gathered on every
    rank the one-process model's with the same stand-in op (the ring's merge rounding otherwise: close, not equal)."""
    ranks, plain, routed, _, attn1 = two_ranks
    for rank, got in enumerate(ranks):
        assert got[mode + "_counts"] == (cp.calls_per_rank(mode, tiny_config(), 2), {})
        assert got[mode].shape == routed.shape and torch.equal(got[mode], ranks[0][mode])
        assert models.agreement(got[mode], routed)["rel_err"] < 5e-3
        assert models.agreement(got[mode], plain)["cosine"] > 0.999
        # the first block's self-attention (its output projection included), this rank's half of the tokens
        assert models.agreement(got[mode + "_attn1"], attn1.chunk(2, dim=1)[rank])["rel_err"] < 5e-3
    if mode == "ulysses":  # whole sequences of one head a rank: the same calls as one process, the same numbers
        assert models.agreement(ranks[0][mode], routed)["rel_err"] < 1e-3


def test_the_ring_reads_the_lse_it_is_given(two_ranks):
    """A drop-in returning the right O with a wrong LSE moves the ring's output: the LSE is read, not recomputed."""
    ranks, _, _, _, attn1 = two_ranks
    for rank, got in enumerate(ranks):
        assert got["ring_wrong_lse_counts"][0] == cp.calls_per_rank("ring", tiny_config(), 2)
        mine = attn1.chunk(2, dim=1)[rank]
        wrong, right = (models.agreement(got[name], mine)["rel_err"] for name in ("ring_wrong_lse_attn1", "ring_attn1"))
        assert wrong > 0.1 and wrong > 30 * right, (wrong, right)


def test_the_entry_s_run_writes_the_results_of_both_gpu_counts(two_ranks):
    """verify.cp._run (what each torchrun rank runs) under Ulysses: the one-process rows and the two-rank rows, counts,
    agreement with the one-process SDPA default, the slowest rank's time, the summary."""
    import json
    ranks, _, _, out, _ = two_ranks
    assert [r["rc"] for r in ranks] == [0, 0]
    (path,) = (out / "results").glob("*/cp-ulysses-2gpu-*.json")
    result = json.loads(path.read_text())
    assert result["kind"] == "capstone-cp" and result["gpus"] == 2 and result["shapes"] == {"32": list(GRID)}
    assert result["attention_calls_per_rank"] == {"1": 4, "2": 4}
    one, two = result["runs"]["1"]["32"], result["runs"]["2"]["32"]
    assert set(one) == set(two) == {"sdpa_default", "stand_in"}
    assert one["stand_in"]["routed"] == 4 and two["stand_in"]["rank_routed"] == [4, 4] and two["stand_in"]["fallbacks"] == {}
    for cell in (*one.values(), *two.values()):
        assert cell["status"] == "ok" and cell["finite"] and len(cell["times_ms"]) == 2 and cell["cosine"] > 0.999
    assert two["stand_in"]["ms"] == max(two["stand_in"]["rank_ms"])
    assert result["speedup_vs_one_gpu_sdpa_default"]["1"]["32"]["sdpa_default"] == 1.0
    assert set(result["speedup_vs_same_gpus_baseline"]["2"]["32"]) == {"sdpa_default", "stand_in"}
    text = cp.summary(result)
    assert "| 2 | 32 | stand_in |" in text and "4 of 4" in text


# ---------------------------------------------------------------- the shapes and the command line

@pytest.mark.parametrize("tokens", sorted(cp.SHAPES))
def test_the_shapes_give_their_token_counts_in_diffusers_model(diffusers, tokens):
    config = capstone.WAN_T2V_1_3B
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**{**config, "num_layers": 1}).to(torch.bfloat16)
    latents = models.make_inputs(config, cp.SHAPES[tokens], "meta")["hidden_states"]
    assert model.patch_embedding(latents).flatten(2).shape[-1] == tokens == capstone.tokens_of(cp.SHAPES[tokens])
    assert all(tokens % n == 0 for n in range(2, 9))  # splits evenly among 2 to 8 ranks


def test_shapes_are_read_or_refused_and_the_calls_counted():
    assert cp.parse_shapes("75600, 32760,4x32x32") == [(21, 90, 160), (21, 60, 104), (4, 32, 32)]
    for bad in ("37633", "2x15x16", ""):
        with pytest.raises(ValueError):
            cp.parse_shapes(bad)
    config = capstone.WAN_T2V_1_3B
    assert cp.calls_per_rank("ulysses", config, 4) == 60 and cp.calls_per_rank("ring", config, 4) == 150


ARG_ERRORS = {
    "--gpus 1": (["--cp", "ring", "--gpus", "1"], "context parallelism needs at least 2 GPUs"),
    "ulysses heads": (["--cp", "ulysses", "--gpus", "8"], "Ulysses splits the model's 12 heads among the GPUs, and 8 does not divide 12"),
    "tokens": (["--cp", "ring", "--gpus", "2", "--shapes", "1x2x6"], "the 3 tokens of 1x2x6 do not split evenly among 2 GPUs"),
    "mode": (["--cp", "tree", "--gpus", "2"], "argument --cp: invalid choice: 'tree'"),
    "no --gpus": (["--cp", "ring"], "the following arguments are required: --gpus"),
    "shape": (["--cp", "ring", "--gpus", "2", "--shapes", "12"], "cannot read '12'"),
    "iters": (["--cp", "ring", "--gpus", "2", "--iters", "0"], "--iters must be at least 1"),
}


@pytest.mark.parametrize("case", ARG_ERRORS)
def test_argument_errors_are_one_line(case, capsys):
    argv, message = ARG_ERRORS[case]
    with pytest.raises(SystemExit) as e:
        capstone.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_the_environment_is_said_in_one_line():
    argv = ["--cp", "ring", "--gpus", "2"]
    ranked = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert cp.environment_reason(2, argv, {}, visible=2) == (
        "not launched by torchrun (no RANK, LOCAL_RANK, WORLD_SIZE in the environment): run "
        "torchrun --standalone --nproc-per-node 2 -m verify.capstone --cp ring --gpus 2")
    assert cp.environment_reason(2, argv, {**ranked, "WORLD_SIZE": "4"}, visible=8) == (
        "torchrun started 4 processes but --gpus is 2: one process per GPU, --nproc-per-node 2")
    assert cp.environment_reason(4, argv, {**ranked, "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0"}, visible=1) == (
        "--gpus 4 but 1 GPU visible (CUDA_VISIBLE_DEVICES='0')")
    assert cp.environment_reason(2, argv, ranked, visible=2) is None


def run_capstone(*argv, **env):
    clean = {k: v for k, v in os.environ.items() if k not in cp.TORCHRUN_ENV}
    return subprocess.run([sys.executable, "-m", "verify.capstone", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**clean, **env})


def test_the_command_line_refuses_a_run_it_cannot_make_in_one_line():
    """Not under torchrun; under a torchrun-like environment without the GPUs (hidden: this runs on the GPU machine too);
    --gpus without --cp. Each before anything is built, in one line."""
    alone = run_capstone("--cp", "ring", "--gpus", "2")
    assert alone.returncode == 1 and alone.stdout == "" and alone.stderr.strip().splitlines() == [
        "python -m verify.capstone --cp: error: not launched by torchrun (no RANK, LOCAL_RANK, WORLD_SIZE in the environment): "
        "run torchrun --standalone --nproc-per-node 2 -m verify.capstone --cp ring --gpus 2"], alone.stderr
    ranked = run_capstone("--cp", "ulysses", "--gpus", "2", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="")
    lines = ranked.stderr.strip().splitlines()
    assert ranked.returncode == 1 and len(lines) == 1 and lines[0].startswith("python -m verify.capstone --cp: error: "), lines
    assert "is a CPU build" in lines[0] or "but 0 GPUs visible" in lines[0], lines
    gpus = run_capstone("--gpus", "2")
    assert gpus.returncode == 2 and "--gpus goes with --cp" in gpus.stderr and len(gpus.stderr.strip().splitlines()) == 1
    help_ = run_capstone("--cp", "ring", "--help")
    assert help_.returncode == 0 and "torchrun" in help_.stdout and "--gpus" in help_.stdout
    assert "--cp" in run_capstone("--help").stdout
