"""GPU: the ring's arithmetic with the real step, on one GPU (skipped without a CUDA GPU).

Two ranks' worth of a ring in one process: the keys and values split into two shards, one call of the step per shard
(attention(q, k_shard, v_shard) with its LSE, each shard with the causal diagonal a ring needs: shard_causal), merged by
verify.cp.merge_partials, and the result judged against the float64 reference of the whole call by verify/checks.py's
verdict (prepare, errors_of), as every step's own calls are. Non-causal, and causal: a square ring of two ranks (rank
0: its own shard top left, the next one skipped; rank 1: shard 0 whole, its own on the diagonal) and a KV cache over
two unequal shards (the last one bottom right). Then the ring drop-in against torch's own cuDNN op on the same call:
the same result format, field by field, and the same O and LSE to the verdict's precision; and diffusers' cuDNN forward
op (what its ring calls per shard) under the drop-in. Only the steps with causal masks (info["causal"]) or the last step.
"""
import pytest

torch = pytest.importorskip("torch")

from verify import cp  # noqa: E402
from verify import steps as steps_mod  # noqa: E402
from verify.checks import errors_of, make_inputs, prepare, replay  # noqa: E402
from verify.tests.conftest import needs_gpu  # noqa: E402

pytestmark = needs_gpu


def ring_step(mod):
    """The steps this file checks: those with causal masks, and the last (the capstone's)."""
    if not (mod.info["causal"] or mod.info["step"] == steps_mod.all_steps()[-1]):
        pytest.skip(f"{mod.info['step']}: the ring's checks run on the steps with causal masks and on the last step")
    return mod


def shard(mod, n):
    """n rounded up to the step's key seqlen multiple (1 for a step that takes any seqlen)."""
    m = mod.info["seqlen_multiple_k"]
    return -(-n // m) * m


def assert_passes(mod, case, o, lse, what):
    failures = errors_of(case, o, lse).failures()
    assert not failures, f"{mod.info['step']} {what}: {'; '.join(failures)}; {replay()}"


def two_shards(mod, q, k, v, sizes, causal=False, what=""):
    """The merged shards (bf16 o, as diffusers' ring gives the model, and float32 o) and the whole call against the
    float64 reference of the whole call."""
    case = prepare(q, k, v, causal=causal, label=what)
    for dtype in (None, torch.float32):
        o, lse = cp.sharded_attention(mod.attention, q, k, v, sizes, causal=causal, dtype=dtype)
        assert_passes(mod, case, o, lse, f"{what}, {len(sizes)} shards merged ({o.dtype})")
    assert_passes(mod, case, *mod.attention(q, k, v, causal=causal), f"{what}, the whole call")


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
def test_two_shards_merged_are_the_whole_call(mod, factor):
    mod = ring_step(mod)
    n = shard(mod, 1024)
    q, k, v = make_inputs(1, 4, n, 2 * n, factor=factor)
    two_shards(mod, q, k, v, (n, n), what=f"x{factor:g} 1x4x{n}x{2 * n}")
    if mod.info["seqlen_multiple_k"] == 1:
        q, k, v = make_inputs(2, 3, 1000, 1500, factor=factor)
        two_shards(mod, q, k, v, (700, 800), what=f"x{factor:g} 2x3x1000x1500, unequal shards")


def test_a_causal_ring_of_two_ranks(mod):
    """A sequence of 2n tokens, causal (top left over the whole): rank r holds queries [r n, (r + 1) n). Rank 0 against
    every key is a top left call (its own shard top left, shard 1 no row sees: skipped, a part of -inf); rank 1 a
    bottom right one (shard 0 whole, its own shard on the diagonal)."""
    mod = ring_step(mod)
    if not mod.info["causal"]:
        pytest.skip(f"{mod.info['step']} has no causal masks")
    n = shard(mod, 1024)
    q, k, v = make_inputs(1, 4, 2 * n, 2 * n)
    assert [cp.shard_causal(n, s * n, n, 0) for s in (0, 1)] == ["top_left", cp.SKIP]
    assert [cp.shard_causal(n, s * n, n, n) for s in (0, 1)] == [False, "top_left"]  # square: top left = bottom right
    for rank, alignment in ((0, "top_left"), (1, "bottom_right")):
        mine = q[:, :, rank * n:(rank + 1) * n]
        two_shards(mod, mine, k, v, (n, n), causal=alignment, what=f"causal ring, rank {rank} of 2 ({alignment})")


def test_a_kv_cache_over_two_shards(mod):
    """300 queries, the last of 1000 keys (bottom right): shard [0, 600) seen whole by every row, [600, 1000) bottom
    right, where the step's bottom-right diagonal is not its top-left one (row i sees keys 0..100 + i of it)."""
    mod = ring_step(mod)
    if not (mod.info["causal"] and mod.info["seqlen_multiple_k"] == 1):
        pytest.skip(f"{mod.info['step']}: needs causal masks and any seqlen")
    q, k, v = make_inputs(2, 2, 300, 1000)
    assert [cp.shard_causal(300, 0, 600, 700), cp.shard_causal(300, 600, 400, 700)] == [False, "bottom_right"]
    two_shards(mod, q, k, v, (600, 400), causal="bottom_right", what="KV cache 2x2x300x1000, bottom right")


def cudnn_call(q, k, v):
    return cp.cudnn_op()(q, k, v, None, True, 0.0, False, False, scale=None)


def test_the_ring_drop_in_answers_as_torch_s_cudnn_op(mod):
    """One shard's call of diffusers' ring ([B, H, N, 128] contiguous, LSE asked for): torch's cuDNN op and the drop-in,
    field by field the same format, the same O and LSE (natural log) within the verdict's bounds of the reference."""
    mod = ring_step(mod)
    n = shard(mod, 1024)
    q, k, v = make_inputs(1, 4, n, n)
    with cp.ring_sdpa(mod, strict=True) as r:
        ours = cudnn_call(q, k, v)
    assert r.routed == 1
    case = prepare(q, k, v, label="one ring shard")
    assert_passes(mod, case, ours[0], ours[1].squeeze(-1) if cp.cudnn_lse_has_trailing_dim() else ours[1], "through the drop-in")
    try:
        theirs = cudnn_call(q, k, v)
    except RuntimeError as e:  # a torch or GPU without cuDNN attention: the format is the meta kernel's (test_cp.py)
        pytest.skip(f"torch's cuDNN attention does not run here: {str(e).splitlines()[0]}")
    assert len(ours) == len(theirs) == 9
    for i in (0, 1):
        assert ours[i].shape == theirs[i].shape and ours[i].dtype == theirs[i].dtype, (i, ours[i].shape, theirs[i].shape)
    assert ours[4:6] == tuple(theirs[4:6])
    for i in (2, 3, 8):  # no cumulative seqlens (dense batches), no debug mask
        assert ours[i] is None and (theirs[i] is None or theirs[i].numel() == 0), (i, theirs[i])
    for i in (6, 7):  # the dropout RNG's seed and offset, which diffusers keeps for a backward: tensors
        assert isinstance(ours[i], torch.Tensor) and isinstance(theirs[i], torch.Tensor), (i, ours[i], theirs[i])
    assert (ours[1] - theirs[1]).abs().max().item() < 1e-2, "the LSE is not cuDNN's (natural log, same layout)"
    assert (ours[0].float() - theirs[0].float()).abs().max().item() < 2e-2


def test_diffusers_cudnn_forward_op_under_the_drop_in(mod):
    """diffusers' forward op of its `_native_cudnn` backend, what its ring attention calls for each K/V shard: with the
    drop-in, the step's O and LSE in diffusers' model layout ([B, S, H, D], [B, S, H]), close to its own cuDNN run's."""
    mod = ring_step(mod)
    import types
    _cudnn_attention_forward_op = pytest.importorskip("diffusers.models.attention_dispatch")._cudnn_attention_forward_op
    n = shard(mod, 1024)
    q, k, v = (t.transpose(1, 2).contiguous() for t in make_inputs(1, 4, n, n))  # [B, S, H, D]
    ctx = types.SimpleNamespace(save_for_backward=lambda *saved: None)
    with torch.no_grad():
        with cp.ring_sdpa(mod, strict=True) as r:
            out, lse = _cudnn_attention_forward_op(ctx, q, k, v, return_lse=True)
        assert r.routed == 1 and out.shape == q.shape and lse.shape == q.shape[:3]
        o_step, lse_step = mod.attention(*(t.transpose(1, 2) for t in (q, k, v)))
        assert torch.equal(out, o_step.transpose(1, 2)) and torch.equal(lse, lse_step.transpose(1, 2))
        try:
            out_cudnn, lse_cudnn = _cudnn_attention_forward_op(ctx, q, k, v, return_lse=True)
        except RuntimeError as e:
            pytest.skip(f"torch's cuDNN attention does not run here: {str(e).splitlines()[0]}")
    assert (lse - lse_cudnn).abs().max().item() < 1e-2 and (out.float() - out_cudnn.float()).abs().max().item() < 2e-2
