"""GPU: every step against the float64 reference, on fresh random inputs (skipped without a CUDA GPU)."""
import pytest

torch = pytest.importorskip("torch")

from verify.checks import fresh_seed, make_inputs, measure_errors, run_poisoned  # noqa: E402
from verify.tests.conftest import needs_gpu  # noqa: E402

pytestmark = needs_gpu

# (batch, heads, seqlen_q, seqlen_k): batch and heads > 1, seqlen_q != seqlen_k, a long one.
SHAPES = [(1, 1, 256, 256), (2, 3, 256, 512), (3, 2, 768, 256), (4, 8, 1024, 1024), (1, 2, 4096, 2048)]


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(mod, shape, factor):
    seed = fresh_seed()
    q, k, v = make_inputs(*shape, factor=factor, seed=seed)
    err = measure_errors(mod, q, k, v)
    assert not err.failures(), f"{mod.__name__} {shape} x{factor}: {err.failures()} ({err}); replay: FLASHLADDER_SEED={seed}"


def test_custom_scale(mod):
    q, k, v = make_inputs(2, 2, 256, 256)
    err = measure_errors(mod, q, k, v, scale=0.3)
    assert not err.failures(), err.failures()


def test_strided_inputs(mod):
    """q, k, v as views of a [batch, seqlen, heads, 128] tensor (the layout most models keep)."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_inputs(2, 4, 512, 512))
    assert not q.is_contiguous()
    err = measure_errors(mod, q, k, v)
    assert not err.failures(), err.failures()


def test_k_and_v_with_different_strides(mod):
    """k contiguous, v a view of a [batch, seqlen, heads, 128] tensor: a k/v stride mix-up would show."""
    q, k, v = make_inputs(2, 4, 256, 512)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert k.stride() != v.stride()
    err = measure_errors(mod, q, k, v)
    assert not err.failures(), err.failures()


def test_kv_broadcast_over_heads(mod):
    """k, v expanded over the heads (stride 0), as multi-query attention keeps them."""
    q, k, v = make_inputs(2, 4, 256, 256)
    k, v = k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1)
    assert k.stride(1) == 0
    err = measure_errors(mod, q, k, v)
    assert not err.failures(), err.failures()


def test_two_calls_bitwise_equal(mod):
    q, k, v = make_inputs(2, 4, 1024, 1024)
    o1, lse1 = run_poisoned(mod, q, k, v)
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), "two calls on the same inputs differ: a race?"


def test_functional_matches_out_variant(mod):
    q, k, v = make_inputs(1, 2, 512, 512)
    o, lse = mod.attention(q, k, v)
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_on_a_side_stream(mod):
    q, k, v = make_inputs(1, 2, 512, 512)
    ref_o, _ = mod.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, _ = mod.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(o, ref_o)


def test_torch_compile_fullgraph(mod):
    q, k, v = make_inputs(1, 2, 512, 512)

    def model(q, k, v):
        o, lse = mod.attention(q * 1.0, k, v)
        return o.float().sum(-1), lse

    eager = model(q, k, v)
    compiled = torch.compile(model, fullgraph=True)(q, k, v)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_cuda_graph_capture(mod):
    q, k, v = make_inputs(1, 2, 512, 512)
    o_eager, lse_eager = mod.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        mod.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = mod.attention(q, k, v)
    q2, k2, v2 = make_inputs(1, 2, 512, 512)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    o_new, lse_new = mod.attention(q, k, v)
    assert not torch.equal(o_new, o_eager), "new inputs should give a new output"
    assert torch.equal(o, o_new) and torch.equal(lse, lse_new), "the replayed graph did not recompute"
