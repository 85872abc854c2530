"""GPU: the kernels the steps are timed beside (torch SDPA's backends and, where installed, FlashAttention-3) against
the same float64 reference and bounds as the steps (verify/checks.py), so that a ratio in the table compares two
correct kernels. SDPA returns no LSE: its O alone is judged. FA3 is judged on both. Skipped without a CUDA GPU;
the FA3 case is skipped where the fa3-fwd package is not installed. The causal table's peers (SDPA cuDNN causal,
with grouped heads too, and FA3 causal) the same way, on causal cases.
"""
import pytest

torch = pytest.importorskip("torch")

from verify import bench  # noqa: E402
from verify.checks import errors_of as errors_with_lse  # noqa: E402
from verify.checks import random_case, replay  # noqa: E402
from verify.tests.conftest import needs_gpu  # noqa: E402

pytestmark = needs_gpu

# (batch, heads, seqlen_q, seqlen_k): one tile, ragged lengths on both sides, and longer rows
SHAPES = [(1, 1, 128, 128), (2, 3, 200, 333), (1, 2, 1024, 2048)]


def peer(name):
    if name == "fa3":
        fa3, why = bench.fa3_attention()
        if fa3 is None:
            pytest.skip(f"FlashAttention-3 {why}")
        return lambda q, k, v, scale: fa3(q, k, v, scale)
    backend = bench.SDPA_BACKENDS[name]

    def sdpa(q, k, v, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale), None
    return sdpa


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", [*bench.SDPA_BACKENDS, *bench.PEERS])
def test_peer_matches_float64_reference(name, shape, factor):
    fn = peer(name)
    case = random_case(*shape, factor)
    try:
        o, lse = fn(case.q, case.k, case.v, case.scale)
    except RuntimeError as e:  # a backend this torch cannot run on this GPU is not in the table either
        pytest.skip(f"{name}: {str(e).splitlines()[0]}")
    torch.cuda.synchronize()
    got = errors_with_lse(case, o, lse if lse is not None else torch.from_numpy(case.lse_ref).float())
    assert not got.failures(), f"{name} {case.label}: {'; '.join(got.failures())} ({got}); {replay()}"


# The causal table's peers (bench.causal_fns), called as the table calls them: SDPA cuDNN with is_causal=True (and
# enable_gqa=True where k/v have fewer heads), FA3 with causal=True; square, so that the two diagonals agree.
# (batch, heads, key/value heads, N): one tile, ragged, multi-query, and Llama-3-8B's grouping (32 over 8).
CAUSAL_SHAPES = [(1, 1, 1, 128), (2, 3, 3, 200), (1, 4, 1, 256), (1, 32, 8, 1024)]


def causal_peer(name):
    if name == "fa3":
        fa3, why = bench.fa3_attention()
        if fa3 is None:
            pytest.skip(f"FlashAttention-3 {why}")
        return lambda q, k, v, scale: fa3(q, k, v, scale, causal="top_left")

    def sdpa(q, k, v, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, bench.SDPA_BACKENDS[name])):
            grouped = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, **grouped), None
    return sdpa


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", bench.CAUSAL_PEERS)
def test_causal_peer_matches_float64_reference(name, shape, factor):
    fn = causal_peer(name)
    batch, heads, heads_k, n = shape
    case = random_case(batch, heads, n, n, factor, causal="top_left", heads_k=heads_k if heads_k != heads else None)
    try:
        o, lse = fn(case.q, case.k, case.v, case.scale)
    except RuntimeError as e:  # a call this torch refuses on the backend (cuDNN and grouped heads, in some versions)
        if "No available kernel" not in str(e):  # is not timed either; any other error is a failure
            raise
        pytest.skip(f"{name}: {bench.refusal(lambda: fn(case.q, case.k, case.v, case.scale))}")
    torch.cuda.synchronize()
    got = errors_with_lse(case, o, lse if lse is not None else torch.from_numpy(case.lse_ref).float())
    assert not got.failures(), f"{name} causal {case.label}: {'; '.join(got.failures())} ({got}); {replay()}"
