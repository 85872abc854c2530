"""GPU: every step against the float64 reference (skipped without a CUDA GPU).

Shapes are counted in the step's own tiles (info["tile_q"], ["tile_k"]), so every step,
whatever its tiles, gets its smallest cases. Inputs come from one seed per run (every failure prints the
FLASHLADDER_SEED=... that replays it); the float64 reference of each case is computed on the GPU in float64
(verify/reference.py). A step with causal masks or grouped key/value heads (info["causal"], info["gqa"]: step15)
is checked with them too, at ragged lengths up to 32760, including rows and whole work tiles that see no key. A step that
takes fp16 (info["dtypes"]: step40) runs the numerics tests in fp16 as well (the `dtype` fixture, conftest.py), and one
that takes head dim 64 (info["head_dims"]: step41) at 64 as well (the `head_dim` fixture).
"""
import re

import pytest

torch = pytest.importorskip("torch")

from verify import steps as steps_mod  # noqa: E402
from verify.checks import (  # noqa: E402
    ADVERSARIAL,
    CAUSAL_ADVERSARIAL,
    CORRUPTIONS,
    adversarial_case,
    check,
    corrupted,
    errors_of,
    make_inputs,
    measure_errors,
    prepare,
    random_case,
    replay,
    run_poisoned,
    run_seed,
)
from verify.tests.conftest import needs_gpu  # noqa: E402

pytestmark = needs_gpu

# (batch, heads, q tiles, k/v tiles)
SHAPES_IN_TILES = [
    (1, 1, 1, 1),    # the smallest call: one block, one K/V tile (no steady state at all)
    (1, 2, 1, 2),    # two K/V tiles: a double buffer's prologue and epilogue with nothing between
    (2, 3, 2, 3),    # batch and heads > 1; three K/V tiles, one more than two buffers
    (3, 2, 6, 4),    # seqlen_q > seqlen_k
    (4, 8, 8, 16),   # more blocks than the GPU holds at once: several waves
    (1, 2, 32, 32),  # long rows (4K x 2K at 128 x 64 tiles)
]


def tiles(mod):
    return mod.info["tile_q"], mod.info["tile_k"]


def in_elements(mod, batch, heads, q_tiles, k_tiles):
    tile_q, tile_k = tiles(mod)
    return batch, heads, q_tiles * tile_q, k_tiles * tile_k


def assert_passes(mod, err, what):
    assert not err.failures(), f"{mod.__name__} {what}: {'; '.join(err.failures())}\n({err}); {replay()}"


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", SHAPES_IN_TILES, ids=lambda s: "tiles" + "x".join(map(str, s)))
def test_matches_float64_reference(mod, shape, factor, dtype, head_dim):
    case = random_case(*in_elements(mod, *shape), factor, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


# (batch, heads, seqlen_q, seqlen_k) for a step that takes any seqlen (info["seqlen_multiple_q"] == 1): the
# last query tile and the last K/V tile cut at every kind of place (the comments count in step14's 128 x 128 tiles).
RAGGED_SHAPES = [
    (1, 1, 1, 1),        # one query, one key
    (1, 2, 5, 300),      # five queries: the second consumer's 64 rows all past the end; keys end 44 into tile 3
    (2, 3, 129, 127),    # one query into a second tile; one key short of a whole tile
    (1, 2, 200, 1000),   # the second consumer's rows partly past the end; keys end 104 into tile 8
    (2, 2, 1000, 77),    # a single, partial K/V tile
    (1, 4, 4095, 4097),  # one query short of 32 tiles; one key into a 33rd tile
    (2, 16, 1000, 333),  # 256 work tiles: each CTA of a persistent grid takes two, with 3 K/V tiles each
]


def takes_any_seqlen(mod):
    return mod.info["seqlen_multiple_q"] == mod.info["seqlen_multiple_k"] == 1


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_any_seqlen(mod, shape, factor, dtype, head_dim):
    """At x1 a zero key that escaped the mask adds e^0 to l against row scores near 3, so it moves the LSE by
    log(1 + escaped / l), >= ~1e-3 at these shapes, ~100x the LSE bound (test_checks.py shows the verdict
    rejecting it). x10 makes the rows peaked, where steps 13-14's conditional rescale rounds a dominant P that the
    yardstick gets exactly (checks.O_P_ROUNDING), and here in outputs of as few as 5 rows."""
    if not takes_any_seqlen(mod):
        pytest.skip("this step needs seqlens that are multiples of its tiles (test_errors.py checks it says so)")
    case = random_case(*shape, factor, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


def test_writes_nothing_past_seqlen_q(mod, head_dim):
    """The rows a step computes past seqlen_q (its last tile's padding) are never stored: o and lse are views at
    the start of larger NaN-poisoned buffers, whose tails must come back untouched."""
    if not takes_any_seqlen(mod):
        pytest.skip("this step needs seqlens that are multiples of its tiles")
    n, extra = 200, 256
    q, k, v = make_inputs(1, 1, n, 333, head_dim=head_dim)
    o_big = torch.full((1, 1, n + extra, head_dim), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse_big = torch.full((1, 1, n + extra), float("nan"), dtype=torch.float32, device=q.device)
    o, lse = o_big[:, :, :n], lse_big[:, :, :n]
    assert o.is_contiguous() and lse.is_contiguous()
    mod.attention_out(q, k, v, o, lse)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "rows before seqlen_q left unwritten"
    assert o_big[:, :, n:].isnan().all(), "o written past seqlen_q"
    assert lse_big[:, :, n:].isnan().all(), "lse written past seqlen_q"


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_adversarial_values(mod, kind, dtype, head_dim):
    """The numpy model's adversarial cases (verify/tests/test_model.py) against the kernel: see checks.ADVERSARIAL."""
    case = adversarial_case(kind, *tiles(mod), dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), f"{case.label}: {ADVERSARIAL[kind]}")


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
def test_checks_reject_one_corrupted_row(mod, factor, dtype, head_dim):
    """The verdict passes this step's output and rejects it with one row of one head (or one LSE entry) wrong."""
    case = random_case(*in_elements(mod, 2, 3, 2, 3), factor, dtype=dtype, head_dim=head_dim)
    o, lse = run_poisoned(mod, case.q, case.k, case.v, case.scale)
    assert_passes(mod, errors_of(case, o, lse), case.label)
    for kind, message in CORRUPTIONS.items():
        bad = errors_of(case, *corrupted(kind, case, o, lse)).failures()
        assert any(message in b for b in bad), f"{case.label}: '{kind}' was not rejected: {bad}; {replay()}"


def test_custom_scale(mod):
    q, k, v = make_inputs(*in_elements(mod, 2, 2, 2, 4))
    assert_passes(mod, measure_errors(mod, q, k, v, scale=0.3), "scale 0.3")


def test_strided_inputs(mod):
    """q, k, v as views of a [batch, seqlen, heads, 128] tensor (the layout most models keep)."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_inputs(*in_elements(mod, 2, 4, 2, 4)))
    assert not q.is_contiguous()
    assert_passes(mod, measure_errors(mod, q, k, v), "[b, n, h, d] views")


def test_o_comes_back_in_the_layout_q_came_in(mod):
    """q as a view of a [batch, seqlen, heads, 128] tensor: attention() returns O laid out the same way (the kernels
    write through O's strides), equal to attention_out's contiguous O, element for element."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_inputs(*in_elements(mod, 2, 4, 2, 4)))
    o, lse = mod.attention(q, k, v)
    assert o.stride() == q.stride() and o.transpose(1, 2).is_contiguous(), (o.stride(), q.stride())
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), f"a strided O differs from a contiguous one; {replay()}"


def test_k_and_v_with_different_strides(mod):
    """k contiguous, v a view of a [batch, seqlen, heads, 128] tensor: a k/v stride mix-up would show."""
    q, k, v = make_inputs(*in_elements(mod, 2, 4, 2, 4))
    v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert k.stride() != v.stride()
    assert_passes(mod, measure_errors(mod, q, k, v), "k, v strides differ")


def test_kv_broadcast_over_heads(mod):
    """k, v expanded over the heads (stride 0), as multi-query attention keeps them."""
    q, k, v = make_inputs(*in_elements(mod, 2, 4, 2, 2))
    k, v = k[:, :1].expand(-1, 4, -1, -1), v[:, :1].expand(-1, 4, -1, -1)
    assert k.stride(1) == 0
    assert_passes(mod, measure_errors(mod, q, k, v), "k, v broadcast over heads")


def test_size_one_dims_with_odd_strides(mod):
    """Batch and heads of 1 with strides that are not multiples of 8 (torch keeps such strides after a
    transpose): never stepped over, so valid."""
    q, k, v = make_inputs(*in_elements(mod, 1, 1, 2, 2))
    q, k, v = (t.as_strided(t.shape, (1, 3, *t.stride()[2:])) for t in (q, k, v))
    assert_passes(mod, measure_errors(mod, q, k, v), "size-1 dims with strides (1, 3, ...)")


def test_two_calls_bitwise_equal(mod):
    q, k, v = make_inputs(*in_elements(mod, 2, 4, 4, 8))
    o1, lse1 = run_poisoned(mod, q, k, v)
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), f"two calls on the same inputs differ: a race? {replay()}"


def test_functional_matches_out_variant(mod):
    q, k, v = make_inputs(*in_elements(mod, 1, 2, 2, 4))
    o, lse = mod.attention(q, k, v)
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert torch.equal(o, o2) and torch.equal(lse, lse2), replay()


# ---------------------------------------------------------------- which code the driver runs

def test_the_driver_runs_the_code_the_gpu_should_get(mod):
    """After a launch, the library says which code the driver loaded (cudaFuncGetAttributes: the PTX version it came
    from, the SASS version it runs): the one binding.code_for picks for this GPU. On an H200: the sm_90a SASS, from
    compute_90a (90, 90); under FLASHLADDER_PTX_JIT (python -m verify --ptx-jit) the compute_80 PTX, compiled by the
    driver for sm_90 (80, 90): the code path of a GPU that has no SASS of its own in the library."""
    import ctypes
    from pathlib import Path

    q, k, v = make_inputs(*in_elements(mod, 1, 1, 1, 1))
    mod.attention(q, k, v)
    torch.cuda.synchronize()
    major, minor = torch.cuda.get_device_capability(q.device)
    code = mod._binding.code_for(mod.info["archs"], major, minor)
    targets = steps_mod.targets(mod.info["step"])
    number = steps_mod.build_step.arch_number
    expected = (number(targets.ptx_source(code)), number(code) if code.startswith("sm_") else 10 * major + minor)
    lib = mod._binding.load_library(Path(mod.info["library"]))  # the same library, loaded once per process
    ptx, binary = ctypes.c_int(), ctypes.c_int()
    assert lib.flashladder_loaded_code(q.device.index, ctypes.byref(ptx), ctypes.byref(binary)) == 0
    assert (ptx.value, binary.value) == expected, (
        f"{mod.info['step']} on sm_{major}{minor}: the driver loaded code from PTX {ptx.value} as SASS {binary.value}, "
        f"expected {code}: {expected}")


# ---------------------------------------------------------------- streams

SLEEP_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: far longer than any step's call at these shapes


def check_on_a_side_stream(mod, attention):
    """On a side stream: long work first, then q overwritten, then the call; read after waiting for that stream
    only. The result is that of the new q only if the call ran on the side stream, behind the copy."""
    q, k, v = make_inputs(*in_elements(mod, 1, 2, 1, 2))
    q_new = make_inputs(*in_elements(mod, 1, 2, 1, 2), seed=run_seed() + 1)[0]
    expected, expected_lse = mod.attention(q_new, k, v)
    old, _ = mod.attention(q, k, v)
    torch.cuda.synchronize()
    assert not torch.equal(expected, old), f"the two inputs should give different outputs; {replay()}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        q.copy_(q_new)
        o, lse = attention(q, k, v)
    side.synchronize()
    assert torch.equal(o, expected) and torch.equal(lse, expected_lse), f"the call did not run on the side stream; {replay()}"


def test_on_a_side_stream(mod):
    check_on_a_side_stream(mod, mod.attention)


def launched_on_stream_zero(attention):
    """A launcher that ignores the current stream: it launches on the legacy default stream (handle 0), which
    does not wait for torch's side streams (they are created non-blocking)."""
    def call(*args):
        with torch.cuda.stream(torch.cuda.default_stream()):
            return attention(*args)
    return call


def launched_on_a_private_stream(attention):
    """A launcher that ignores the current stream for a stream of its own."""
    private = torch.cuda.Stream()
    def call(*args):
        with torch.cuda.stream(private):
            return attention(*args)
    return call


@pytest.mark.parametrize("wrong", [launched_on_stream_zero, launched_on_a_private_stream], ids=["stream0", "private"])
def test_side_stream_check_catches_a_launcher_that_ignores_the_stream(mod, wrong):
    """The side-stream check itself, shown to fail on two wrong launchers: once, on the final step's."""
    if mod.info["step"] != steps_mod.all_steps()[-1]:
        pytest.skip("the side-stream check's own test runs once, on the final step")
    with pytest.raises(AssertionError, match="did not run on the side stream"):
        check_on_a_side_stream(mod, wrong(mod.attention))
    torch.cuda.synchronize()


# ---------------------------------------------------------------- torch.compile, CUDA graphs

def compile_backend(mod) -> str:
    """torch.compile's backend for a step's op: inductor (its code generation, minutes of CPU) on the final step, and
    aot_eager (dynamo's graph and the op's fake implementation, what every step's binding shares) on the others."""
    return "inductor" if mod.info["step"] == steps_mod.all_steps()[-1] else "aot_eager"


def test_torch_compile_fullgraph(mod):
    q, k, v = make_inputs(*in_elements(mod, 1, 2, 2, 4))

    def model(q, k, v):
        o, lse = mod.attention(q * 1.0, k, v)
        return o.float().sum(-1), lse

    eager = model(q, k, v)
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend(mod))(q, k, v)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]), replay()


def test_cuda_graph_capture(mod):
    shape = in_elements(mod, 1, 2, 2, 4)
    q, k, v = make_inputs(*shape)
    o_eager, lse_eager = mod.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        mod.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = mod.attention(q, k, v)
    q2, k2, v2 = make_inputs(*shape, seed=run_seed() + 1)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    o_new, lse_new = mod.attention(q, k, v)
    assert not torch.equal(o_new, o_eager), f"new inputs should give a new output; {replay()}"
    assert torch.equal(o, o_new) and torch.equal(lse, lse_new), f"the replayed graph did not recompute; {replay()}"


# ---------------------------------------------------------------- causal masks and grouped key/value heads (step15 on)
# Only for the steps that take them (info["causal"], info["gqa"]); the others refuse them (test_errors.py). The comments
# count in step15's 128 x 128 tiles.

ALIGNMENTS = ["top_left", "bottom_right"]


def needs_causal(mod):
    if not mod.info["causal"]:
        pytest.skip(f"{mod.info['step']} has no causal masks (info['causal']): test_errors.py checks that it refuses them")
    if not takes_any_seqlen(mod):
        pytest.skip("these shapes need a step that takes any seqlen")


def needs_gqa(mod):
    if not mod.info["gqa"]:
        pytest.skip(f"{mod.info['step']} needs as many key/value heads as query heads (info['gqa']): test_errors.py checks "
                    "that it refuses fewer")
    if not takes_any_seqlen(mod):
        pytest.skip("these shapes need a step that takes any seqlen")


# (batch, heads, seqlen_q, seqlen_k): ragged lengths 1, 127, 129, 1000, 32760, seqlen_q below, equal to and above seqlen_k
CAUSAL_SHAPES = [
    (1, 1, 1, 1),          # one query, one key: both corners, the same single score
    (1, 2, 1, 1000),       # one query: top left it sees key 0 alone, bottom right every key
    (1, 2, 1000, 1),       # one key: top left every row sees it; bottom right only the last row, 999 see nothing
    (2, 3, 127, 129),      # seqlen_q < seqlen_k by 2: bottom right, the diagonal 2 keys right of top left's
    (2, 3, 129, 127),      # seqlen_q > seqlen_k by 2: bottom right, the first 2 rows see no key
    (1, 2, 1000, 1000),    # square: both corners one diagonal, through 8 tiles
    (2, 2, 200, 1000),     # short q, long k: bottom right, each row sees 801 keys or more (top left, at most 200)
    (2, 2, 1000, 129),     # long q, short k: bottom right, 871 rows (6 whole query tiles and more) see nothing
    (1, 4, 4095, 4097),    # one query short of 32 tiles, one key into a 33rd
    (1, 1, 127, 32760),    # a KV cache: a few new queries against 32K keys (bottom right: 255 K tiles for every row)
    (1, 1, 32760, 1000),   # bottom right: 31760 rows, 248 whole query tiles, see no key
    (1, 1, 32760, 32760),  # the longest, square (one corner: the other's diagonal is the same)
]
CAUSAL_CASES = [(shape, a) for shape in CAUSAL_SHAPES for a in ALIGNMENTS if not (shape[2] == shape[3] > 4096 and a == "bottom_right")]


@pytest.mark.parametrize("shape, alignment", CAUSAL_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_causal(mod, shape, alignment, dtype, head_dim):
    needs_causal(mod)
    case = random_case(*shape, 1.0, alignment, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("shape", [(2, 3, 127, 129), (2, 3, 129, 127), (2, 2, 200, 1000), (2, 2, 1000, 129)],
                         ids=lambda s: "x".join(map(str, s)))
def test_causal_x10(mod, shape, alignment, dtype, head_dim):
    """Peaked rows (inputs x10) under the mask: a row near the diagonal sees few keys, one of which dominates."""
    needs_causal(mod)
    case = random_case(*shape, 10.0, alignment, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


# (batch, heads, heads_k, seqlen_q, seqlen_k): GQA 32/8 and 8/2, MQA (one key/value head), and heads_k = heads
GROUPED_SHAPES = [(2, 32, 8, 300, 1000), (2, 32, 8, 1000, 129), (1, 32, 1, 300, 1000), (2, 8, 1, 1000, 129),
                  (3, 8, 2, 129, 127), (1, 4, 4, 200, 333)]


@pytest.mark.parametrize("causal", [False, *ALIGNMENTS], ids=str)
@pytest.mark.parametrize("shape", GROUPED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_key_value_heads(mod, shape, causal, dtype, head_dim):
    """Query head h reads key/value head h // (heads // heads_k): a step reading h % heads_k (or any other map) fails
    here for 32/8, 8/2 (test_checks.py shows the verdict rejecting it)."""
    needs_gqa(mod)
    if causal:
        needs_causal(mod)
    batch, heads, heads_k, nq, nk = shape
    case = random_case(batch, heads, nq, nk, 1.0, causal, heads_k, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


# (batch, heads, heads_k, seqlen_q, seqlen_k), bottom right with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows
# see no key
KEYLESS_SHAPES = [
    (2, 2, 2, 1000, 100),   # 900 rows: 7 whole query tiles with no visible key, and 4 rows of the eighth
    (1, 3, 3, 129, 1),      # 128 rows: one whole query tile; the last row sees the one key
    (1, 2, 2, 300, 44),     # 256 rows: two whole tiles, exactly
    (2, 8, 2, 1000, 333),   # grouped heads too
    (1, 1, 1, 32760, 127),  # 32633 rows: 254 whole tiles
]


@pytest.mark.parametrize("shape", KEYLESS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rows_that_see_no_key_are_zero_and_minus_inf(mod, shape, dtype, head_dim):
    """Exactly: o = 0 and lse = -inf in every row that sees no key (whole work tiles of them included), written over
    the NaN poison; the rows after them within the verdict's bounds; the functional API the same."""
    needs_causal(mod)
    batch, heads, heads_k, nq, nk = shape
    if heads_k != heads:
        needs_gqa(mod)
    q, k, v = make_inputs(batch, heads, nq, nk, heads_k=heads_k, dtype=dtype, head_dim=head_dim)
    case = prepare(q, k, v, causal="bottom_right", label=f"{'x'.join(map(str, shape))} bottom right, {dtype}")
    o, lse = run_poisoned(mod, q, k, v, causal="bottom_right")
    none = nq - nk
    assert torch.equal(o[:, :, :none], torch.zeros_like(o[:, :, :none])), \
        f"o != 0 in rows that see no key: {int((o[:, :, :none] != 0).any(-1).sum())} rows; {replay()}"
    assert torch.isneginf(lse[:, :, :none]).all(), \
        f"lse != -inf in rows that see no key: {int((~torch.isneginf(lse[:, :, :none])).sum())} rows; {replay()}"
    assert torch.isfinite(lse[:, :, none:]).all() and torch.isfinite(o).all(), replay()
    assert_passes(mod, errors_of(case, o, lse), case.label)
    o2, lse2 = mod.attention(q, k, v, causal="bottom_right")
    assert torch.equal(o2, o) and torch.equal(lse2, lse), replay()


def test_causal_writes_nothing_past_seqlen_q(mod):
    """A query tile with no visible key may be finished early (o = 0, lse = -inf without a K tile): still nothing past
    seqlen_q. o and lse are views at the start of larger NaN-poisoned buffers."""
    needs_causal(mod)
    for nq, nk, alignment in ((200, 50, "bottom_right"), (200, 333, "top_left"), (5, 1, "bottom_right")):
        extra = 256
        q, k, v = make_inputs(1, 1, nq, nk)  # one head: the views below are then contiguous, as attention_out needs
        o_big = torch.full((1, 1, nq + extra, 128), float("nan"), dtype=torch.bfloat16, device=q.device)
        lse_big = torch.full((1, 1, nq + extra), float("nan"), dtype=torch.float32, device=q.device)
        o, lse = o_big[:, :, :nq], lse_big[:, :, :nq]
        mod.attention_out(q, k, v, o, lse, causal=alignment)
        torch.cuda.synchronize()
        assert not o.isnan().any() and not lse.isnan().any(), f"{nq}x{nk} {alignment}: rows before seqlen_q left unwritten"
        assert o_big[:, :, nq:].isnan().all() and lse_big[:, :, nq:].isnan().all(), f"{nq}x{nk} {alignment}: written past seqlen_q"


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("kind", [*CAUSAL_ADVERSARIAL, *ADVERSARIAL])
def test_causal_adversarial_values(mod, kind, alignment, dtype, head_dim):
    """The adversarial cases under either corner's mask (1 x 2 x 2 tiles x 8 tiles): top left, the first rows see their
    diagonal tile alone and no row sees the last 6 K tiles; bottom right, every row sees the first 6. The causal one
    (masked_keys_above_by_100) puts the keys a row must not see ~100 nats above the ones it sees, in its diagonal tile."""
    needs_causal(mod)
    case = adversarial_case(kind, *tiles(mod), alignment, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), f"{case.label}: {CAUSAL_ADVERSARIAL.get(kind) or ADVERSARIAL[kind]}")


@pytest.mark.parametrize("causal", [False, *ALIGNMENTS], ids=str)
def test_strided_views_with_grouped_heads(mod, causal):
    """q, k, v as views of [batch, seqlen, heads, 128] tensors with fewer key/value heads; and as slices of one fused
    [batch, seqlen, heads + 2 heads_k, 128] projection (a language model's fused QKV), where the head strides of q, k and
    v are those of the fused tensor."""
    needs_gqa(mod)
    if causal:
        needs_causal(mod)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_inputs(2, 8, 300, 1000, heads_k=2))
    assert not q.is_contiguous() and k.stride(1) == 128
    assert_passes(mod, measure_errors(mod, q, k, v, causal=causal), f"[b, n, h, d] views, 8/2 heads, causal {causal}")
    q, k, v = make_inputs(2, 8, 1000, 1000, heads_k=2)
    fused = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2)  # [2, 1000, 12, 128]
    q, k, v = (fused[:, :, a:b].transpose(1, 2) for a, b in ((0, 8), (8, 10), (10, 12)))
    assert k.stride() == (1000 * 12 * 128, 128, 12 * 128, 1) and k.data_ptr() % 16 == 0
    assert_passes(mod, measure_errors(mod, q, k, v, causal=causal), f"fused QKV slices, 8/2 heads, causal {causal}")


def test_causal_and_grouped_calls_are_deterministic_and_the_apis_agree(mod):
    needs_causal(mod)
    heads_k = 2 if mod.info["gqa"] else 8
    q, k, v = make_inputs(2, 8, 1000, 333, heads_k=heads_k)
    for alignment in ALIGNMENTS:
        o1, lse1 = run_poisoned(mod, q, k, v, causal=alignment)
        o2, lse2 = run_poisoned(mod, q, k, v, causal=alignment)
        o3, lse3 = mod.attention(q, k, v, causal=alignment)
        assert torch.equal(o1, o2) and torch.equal(lse1, lse2), f"{alignment}: two calls differ: a race? {replay()}"
        assert torch.equal(o1, o3) and torch.equal(lse1, lse3), f"{alignment}: attention() and attention_out() differ; {replay()}"
    assert not torch.equal(mod.attention(q, k, v, causal="top_left")[0], mod.attention(q, k, v, causal="bottom_right")[0])


def test_causal_grouped_under_torch_compile_and_in_a_cuda_graph(mod):
    needs_causal(mod)
    heads_k = 2 if mod.info["gqa"] else 4
    q, k, v = make_inputs(1, 4, 300, 1000, heads_k=heads_k)

    def model(q, k, v):
        o, lse = mod.attention(q * 1.0, k, v, causal="bottom_right")
        return o.float().sum(-1), lse
    eager = model(q, k, v)
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend(mod))(q, k, v)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]), replay()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mod.attention(q, k, v, causal="top_left")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = mod.attention(q, k, v, causal="top_left")
    q2, k2, v2 = make_inputs(1, 4, 300, 1000, heads_k=heads_k, seed=run_seed() + 1)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    o_new, lse_new = mod.attention(q, k, v, causal="top_left")
    assert torch.equal(o, o_new) and torch.equal(lse, lse_new), f"the replayed graph did not recompute; {replay()}"


# A step that runs some calls in CTA pairs (info["pair_min_seqlen_k"]: two CTAs of a cluster on neighbouring Q tiles,
# each K/V tile multicast to both), dense calls from that many keys on with an even number of Q tiles, and, where
# info["causal_pair_min_seqlen_k"], causal calls with the diagonal at or right of the top-left one and a multiple of 4
# Q tiles per head. (batch, heads, heads_k, seqlen_q, keys past the threshold, whether a dense call takes the pairs):
PAIR_SHAPES = [
    (1, 2, 2, 256, 0, True),      # the shortest call that takes them: one CTA pair, the last K/V tile partial
    (2, 3, 3, 250, 1, True),      # one key into a further tile; the pair's second Q tile partial
    (1, 18, 18, 1024, 0, True),   # 144 work tiles: 12 of the 66 pairs take two, the ring's phases run across work tiles
    (2, 2, 2, 1000, 24568, True),  # 32760 keys, a video model's sequence; 8 Q tiles per head, the last partial
    (1, 8, 2, 256, 0, True),      # grouped heads: the pair reads the one K/V head of its query head
    (1, 2, 2, 384, 0, False),     # three Q tiles: an odd count, so one CTA per cluster (pairs need whole pairs)
    (1, 2, 2, 256, -1, False),    # one key short of the threshold: one CTA per cluster
]


def needs_pairs(mod):
    if mod.info["pair_min_seqlen_k"] is None:
        pytest.skip(f"{mod.info['step']} runs no call in CTA pairs (info['pair_min_seqlen_k'] is None)")


def pair_shape(mod, shape):
    batch, heads, heads_k, nq, past, _ = shape
    return batch, heads, heads_k, nq, mod.info["pair_min_seqlen_k"] + past


@pytest.mark.parametrize("factor", [1.0, 10.0], ids=["x1", "x10"])
@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + ("-paired" if s[5] else "-solo"))
def test_pairs(mod, shape, factor, dtype):
    needs_pairs(mod)
    batch, heads, heads_k, nq, nk = pair_shape(mod, shape)
    if heads_k != heads:
        needs_gqa(mod)
    case = random_case(batch, heads, nq, nk, factor, heads_k=None if heads_k == heads else heads_k, dtype=dtype)
    assert_passes(mod, check(mod, case), case.label)


def launched_kernels(fn) -> list[str]:
    """The names of the CUDA kernels that fn() launches, as torch's profiler records them."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# Causal calls in CTA pairs (info["causal_pair_min_seqlen_k"]): (batch, heads, heads_k, seqlen_q, keys past the
# threshold). Top left and bottom right (seqlen_k > seqlen_q: the diagonal right of top left's), the lower Q tile of
# each pair passing over the K/V tiles that only the higher one sees.
CAUSAL_PAIR_SHAPES = [
    (1, 2, 2, 512, 0),      # one quadruple of Q tiles: one CTA pair, two rounds
    (2, 3, 3, 1000, 1),     # 8 Q tiles, the last partial; one key into a further K/V tile
    (1, 40, 40, 1024, 0),   # 160 rounds of pairs on 132 CTAs: some take two, the ring's phases run across work tiles
    (1, 8, 2, 512, 0),      # grouped heads
    (1, 4, 4, 4096, 0),     # square (top left and bottom right the same diagonal): a language model's prefill
]


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("shape", CAUSAL_PAIR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pairs_causal(mod, shape, alignment, dtype):
    needs_pairs(mod)
    if mod.info["causal_pair_min_seqlen_k"] is None:
        pytest.skip(f"{mod.info['step']} runs causal calls one CTA per cluster (info['causal_pair_min_seqlen_k'] is None)")
    batch, heads, heads_k, nq, nk = pair_shape(mod, (*shape, True))
    if heads_k != heads:
        needs_gqa(mod)
    case = random_case(batch, heads, nq, nk, 1.0, alignment, heads_k=None if heads_k == heads else heads_k, dtype=dtype)
    assert_passes(mod, check(mod, case), case.label)


def causal_takes_pairs(mod, nq, nk, alignment) -> bool:
    """The launcher's rule for causal calls (the step's flashladder_fwd): CTA pairs from info["causal_pair_min_seqlen_k"]
    keys (None: never), with the diagonal at or right of the top-left one and 4k Q tiles per head."""
    q_tiles = -(-nq // mod.info["tile_q"])
    offset = 0 if alignment == "top_left" else nk - nq
    least = mod.info["causal_pair_min_seqlen_k"]
    return least is not None and nk >= least and offset >= 0 and q_tiles % 4 == 0


@pytest.mark.parametrize("shape", PAIR_SHAPES + [(*s, True) for s in CAUSAL_PAIR_SHAPES],
                         ids=lambda s: "x".join(map(str, s[:5])) + ("-paired" if s[5] else "-solo"))
def test_the_launcher_picks_the_kernel_the_shape_calls_for(mod, shape):
    """The pair tests above test the paired kernel only if the launcher takes it there: the kernel's first template
    bool argument says which (attention_fwd_kernel<..., true, ...>: PAIRED). Causal calls take it only on a step with
    info["causal_pair_min_seqlen_k"], by its rule. A third template argument (<PAIRED, SPLIT, CAUSAL>) says which calls
    the kernel is built for: causal calls need the causal one, and dense ones are meant to run the dense one."""
    needs_pairs(mod)
    batch, heads, heads_k, nq, nk = pair_shape(mod, shape)
    q, k, v = make_inputs(batch, heads, nq, nk, heads_k=heads_k)
    for causal, want in ((False, shape[5]), *((a, causal_takes_pairs(mod, nq, nk, a)) for a in ALIGNMENTS)):
        if causal and not mod.info["causal"]:
            continue
        names = [n for n in launched_kernels(lambda: mod.attention(q, k, v, causal=causal)) if "attention_fwd_kernel" in n]
        assert len(names) == 1, names
        flags = kernel_flags(names[0])  # [PAIRED], [PAIRED, SPLIT] or [PAIRED, SPLIT, CAUSAL]
        assert flags[0] == want, f"{'x'.join(map(str, (batch, heads, nq, nk)))} causal {causal}: {names[0]}"
        assert len(flags) < 3 or flags[2] == bool(causal), f"causal {causal} ran {names[0]}"


def kernel_flags(name: str) -> list[bool]:
    """The bool template arguments of a forward kernel's name, in order: attention_fwd_kernel<__nv_bfloat16, 128, true,
    false, false> (step41 on: the type, the head dim, then PAIRED, SPLIT, CAUSAL) gives [True, False, False]; step40's
    has no head dim, step39's no type, step20's no CAUSAL, and the paired kernels before it PAIRED alone."""
    args = re.search(r"attention_fwd_kernel<([^<>]*)>", name)
    flags = [a == "true" for a in re.findall(r"\b(true|false)\b", args.group(1))] if args else []
    assert 1 <= len(flags) <= 3, f"no PAIRED, SPLIT, CAUSAL arguments in {name}"
    return flags


def test_pairs_are_deterministic(mod):
    """Two calls in CTA pairs bitwise equal: the pair's shared ring (each CTA's slots filled by both producers, emptied
    by both CTAs' consumers) is where a race would show."""
    needs_pairs(mod)
    q, k, v = make_inputs(1, 18, 1024, mod.info["pair_min_seqlen_k"] + 1000)
    for causal in (False, "top_left") if mod.info["causal_pair_min_seqlen_k"] else (False,):  # causal: the pass-overs too
        o1, lse1 = run_poisoned(mod, q, k, v, causal=causal)
        o2, lse2 = run_poisoned(mod, q, k, v, causal=causal)
        assert torch.equal(o1, o2) and torch.equal(lse1, lse2), f"two calls differ (causal {causal}): a race? {replay()}"


# A step with a split tail (info["workspace"]): a dense call whose work tiles leave the grid's last round partly
# empty has that round's tiles cut along their K/V walks, the pieces dealt out evenly to the CTAs and merged by the one
# that holds each walk's start. The counts below are for a GPU of 132 SMs (H100 SXM, H200); elsewhere they are
# other splits, checked all the same. (batch, heads, heads_k, seqlen_q, seqlen_k):
TAIL_SHAPES = [
    (1, 25, 25, 1024, 1024),   # 200 work tiles: 68 in the last round, as at the shapes of record; 4-5 of 8 K/V tiles a CTA
    (1, 17, 17, 1024, 1024),   # 136: 4 in the last round, 32 K/V tiles for 132 CTAs: an owner and 7 partials a walk
    (2, 9, 9, 1000, 3001),     # ragged: 12 tiles of 24 K/V tiles, the owner's first one partial, the last Q tile partial
    (1, 34, 2, 1024, 1024),    # grouped heads: 8 tiles in the last round
    (1, 140, 140, 128, 128),   # one K/V tile a walk: nothing to cut, every piece whole
    (1, 68, 68, 256, 4096),    # CTA pairs: 68 pairs on 66 clusters, 2 x 32 units for 66 runs (two of them empty)
    (1, 70, 70, 256, 5096),    # CTA pairs, 4 pairs in the last round, its walks' first K/V tile partial
]


def needs_split_tail(mod):
    if not mod.info["workspace"]:
        pytest.skip(f"{mod.info['step']} runs every work tile whole (info['workspace'] is False)")


@pytest.mark.parametrize("shape", TAIL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_tail(mod, shape, dtype, head_dim):
    needs_split_tail(mod)
    batch, heads, heads_k, nq, nk = shape
    if heads_k != heads:
        needs_gqa(mod)
    case = random_case(batch, heads, nq, nk, 1.0, heads_k=None if heads_k == heads else heads_k, dtype=dtype, head_dim=head_dim)
    assert_passes(mod, check(mod, case), case.label)


def run_unsplit(mod, q, k, v):
    """One call through the step's library with no workspace: every work tile whole."""
    import ctypes
    import math
    from pathlib import Path
    binding = mod._binding
    lib = binding.load_library(Path(mod.info["library"]))
    o = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    params = binding.make_params(q, k, v, o, lse, 1.0 / math.sqrt(binding.HEAD_DIM), 0, None)
    assert lib.flashladder_fwd(ctypes.byref(params), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == 0
    torch.cuda.synchronize()
    return o, lse


def test_the_last_round_is_split_and_the_whole_rounds_are_not(mod):
    """The tests above test the split only if the step takes it: the tiles of the whole rounds come out bitwise as a call
    without a workspace gives them, and some tile of the last round does not (its sums run in another order)."""
    needs_split_tail(mod)
    batch, heads, nq, nk = 1, 25, 1024, 1024
    q, k, v = make_inputs(batch, heads, nq, nk)
    o, lse = run_poisoned(mod, q, k, v)
    o0, lse0 = run_unsplit(mod, q, k, v)
    q_tiles, sms = nq // mod.info["tile_q"], torch.cuda.get_device_properties(q.device).multi_processor_count
    tiles = q_tiles * heads * batch
    whole = tiles // min(tiles, sms) * min(tiles, sms)
    rows = lambda t: (t // q_tiles // heads, t // q_tiles % heads, slice(t % q_tiles * 128, t % q_tiles * 128 + 128))  # noqa: E731
    for t in range(whole):
        b, h, r = rows(t)
        assert torch.equal(o[b, h, r], o0[b, h, r]) and torch.equal(lse[b, h, r], lse0[b, h, r]), f"whole tile {t} differs"
    differ = [t for t in range(whole, tiles) if not torch.equal(o[rows(t)], o0[rows(t)])]
    assert differ, f"the {tiles - whole} tiles of the last round are bitwise those of a call without a workspace: not split"


@pytest.mark.parametrize("shape", [TAIL_SHAPES[1], TAIL_SHAPES[5]], ids=lambda s: "x".join(map(str, s)))
def test_split_tail_is_deterministic(mod, shape):
    """Two calls bitwise equal: the partials merge in one order, each after its flag."""
    needs_split_tail(mod)
    q, k, v = make_inputs(shape[0], shape[1], shape[3], shape[4])
    o1, lse1 = run_poisoned(mod, q, k, v)
    o2, lse2 = run_poisoned(mod, q, k, v)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), f"two calls differ: a race in the merge? {replay()}"


def test_each_stream_has_a_workspace_of_its_own_and_a_captured_call_none(mod, monkeypatch):
    """The binding's workspaces, read where it hands them to the kernel (make_params): one per stream, never shared by two
    (calls on two streams may overlap; the test above sees a shared one only if their tails do), and none for a call
    captured into a CUDA graph (a replay would share the capturing stream's with every later call on it)."""
    needs_split_tail(mod)
    seen, real = [], mod._binding.abi.make_params

    def spy(*args, **kwargs):
        params = real(*args, **kwargs)
        seen.append((torch.cuda.current_stream().cuda_stream, params.workspace))
        return params
    monkeypatch.setattr(mod._binding.abi, "make_params", spy)
    q, k, v = make_inputs(1, 25, 1024, 1024)
    streams = [torch.cuda.Stream() for _ in range(2)]
    for _ in range(2):
        for s in streams:
            with torch.cuda.stream(s):
                mod.attention(q, k, v)
    torch.cuda.synchronize()
    per_stream = {s.cuda_stream: {w for st, w in seen if st == s.cuda_stream} for s in streams}
    assert all(len(w) == 1 and None not in w for w in per_stream.values()), f"a stream's calls had workspaces {per_stream}"
    assert len(set.union(*per_stream.values())) == len(streams), f"two streams share a workspace: {per_stream}"
    seen.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.attention(q, k, v)
    torch.cuda.synchronize()
    assert [w for _, w in seen] == [None], f"a captured call was given workspace {seen}"


def test_split_tail_on_two_streams_at_once(mod):
    """Calls on two streams at once, each stream with its own workspace, give what the same calls give one by one."""
    needs_split_tail(mod)
    inputs = [make_inputs(1, 25, 1024, 1024, seed=run_seed() + i) for i in range(2)]
    alone = [run_poisoned(mod, *x) for x in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    outs = [[] for _ in inputs]
    torch.cuda.synchronize()
    for _ in range(8):
        for s, x, out in zip(streams, inputs, outs):
            with torch.cuda.stream(s):
                out.append(mod.attention(*x))
    torch.cuda.synchronize()
    for i, (out, (o, lse)) in enumerate(zip(outs, alone)):
        for o2, lse2 in out:
            assert torch.equal(o2, o) and torch.equal(lse2, lse), f"stream {i}: a call differs from the same call alone"
