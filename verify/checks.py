"""Numerical checks of a step against the float64 reference (verify/reference.py), and the inputs they use.

The verdict on one call's outputs (Errors.failures):
  * no NaN/Inf anywhere; outputs are poisoned with NaN before the call, so an unwritten element fails;
  * O:   relative Frobenius error <= O_REL_FROB (fp16: O_REL_FROB_FP16), and every element's abs error <= O_YARDSTICK_FACTOR x the
         yardstick's max + O_P_ROUNDING x |O_ref| there + O_ATOL;
  * LSE: max abs error <= LSE_YARDSTICK_FACTOR x the yardstick's + LSE_ULPS fp32 ulps of the largest |LSE|.
The yardstick (yardstick_attention) is attention computed the way the kernels compute it, in plain torch:
its measured error on the same inputs is what the kernels' precision class costs there, so the bounds scale
with the inputs (at x10 the outputs are ~10x larger and so are the errors of any bf16 attention).
Causal calls (causal="top_left" or "bottom_right") and grouped key/value heads (k, v with fewer heads than q) are
judged the same way, against a reference and a yardstick that take the mask and the heads too. A row that sees no
key (bottom_right with seqlen_q > seqlen_k: the first rows) has o = 0 and lse = -inf, exactly, or the verdict fails.

Inputs are fresh every run, with a non-zero mean (a zero mean hides errors in the max handling), all drawn
from one seed per run: FLASHLADDER_SEED=<seed> replays a run, and every failure message says so.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verify.reference import CHUNK_SCORES, attention_reference_of, attention_reference_torch, causal_offset

HEAD_DIM = 128  # the inputs' head dim unless a case says another (head_dim: the steps that take it, info["head_dims"])
DEFAULT_SCALE = 1.0 / math.sqrt(HEAD_DIM)  # the scale at 128; at any head dim d, 1 / sqrt(d) (default_scale)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
INPUT_MEAN = 0.5

# A global bound on the whole output, ~10x what rounding O to bf16 alone costs (~2^-9 relative): it catches
# errors spread thinly over many elements, which the per-element bound alone would let through.
O_REL_FROB = 1e-2
O_REL_FROB_FP16 = O_REL_FROB / 8  # the same for fp16 inputs: 3 more bits of precision
# FlashAttention's own tests allow 2x the max error of a reference computed in the same precision; here both
# are dominated by rounding O to bf16 (half an ulp of |O|), so a kernel in the class lands near 1x, except on
# peaked rows under FA4's rescale (O_P_ROUNDING, next).
O_YARDSTICK_FACTOR = 2.0
# One bf16 rounding of a row's dominant probability, relative to |O|: where one key dominates a row, O is
# about that key's V row, so the rounding of its P moves O by up to 2^-8 |O| (rows that are not one-hot round
# several P of similar size, as the yardstick does, and the 2x term covers them).
# The yardstick shifts every row by its exact max, so its dominant key gets P = 2^0 = 1, exact in bf16, and no
# rounding error where the row is peaked; a kernel whose shift lags the max (FlashAttention-4's conditional
# rescale, steps 13-14: the shift moves only when the max passes it by more than 8 in log2 units) rounds that
# P, anywhere in [1, 2^8], like any other: up to 2^-8 relative. Without this term such a kernel, exact in every
# other way, fails the 2x bound on peaked rows (scale 0.3, or inputs x10): test_checks.py's CPU model of it
# does (test_fa4_rescale_needs_the_p_rounding_term), and so did steps 13 and 14 on the H200 (NOTES.md, "The O
# bound and peaked rows").
O_P_ROUNDING = 2.0**-8
# The same for fp16 inputs (steps that take them, info["dtypes"]): P and O rounded to fp16, 11 bits of precision where
# bf16 has 8, so one rounding of P costs up to 2^-11 |O|; the yardstick rounds in the inputs' type too.
O_P_ROUNDING_FP16 = 2.0**-11


def p_rounding_of(dtype) -> float:
    """O_P_ROUNDING of inputs of this dtype (read when asked: tests set the constants)."""
    return O_P_ROUNDING_FP16 if dtype == torch.float16 else O_P_ROUNDING


def rel_frob_of(dtype) -> float:
    """O_REL_FROB of inputs of this dtype."""
    return O_REL_FROB_FP16 if dtype == torch.float16 else O_REL_FROB
# For outputs that the yardstick gets exactly (e.g. O = the V row of one dominant key, a bf16 value):
# far below a bf16 ulp of |O| ~ 1 (2^-7), so it never hides a real error.
O_ATOL = 1e-4
# LSE = m * scale + log(l) rests on the scores more directly than O does, and the tensor cores accumulate the
# scores with truncation where the yardstick's fp32 GEMM rounds to nearest: 4x leaves room for that.
LSE_YARDSTICK_FACTOR = 4.0
# The floor, for rows whose LSE is one score: with a single key (or one key far above the rest) nothing averages
# the tensor cores' truncating fp32 accumulation of that score, a few ulps at the LSE's magnitude, where the
# yardstick's own error can be far smaller (one key at x10, once: ~9x the yardstick, ~2 ulps of |LSE|). Then
# m * scale and + log(l) round once more each. A bound from one sample: a row whose dot product cancels a lot
# could need more (the error scales with the sum of |q_i k_i|, not with |LSE|). 4 ulps stays several times
# below the corrupted LSE entry that must fail at x10 (CORRUPTIONS below; test_checks.py shows it fails).
LSE_ULPS = 4.0


@functools.lru_cache(maxsize=None)
def run_seed() -> int:
    """The seed of this run's random inputs: $FLASHLADDER_SEED, else a fresh one. Exported to the environment
    so that processes started afterwards (the checks of each step) draw the same inputs."""
    text = os.environ.get("FLASHLADDER_SEED") or str(int.from_bytes(os.urandom(4), "little"))
    if not text.isdigit():
        raise SystemExit(f"FLASHLADDER_SEED={text!r}: expected a non-negative integer (the seed a failure printed)")
    seed = int(text)
    os.environ["FLASHLADDER_SEED"] = str(seed)
    return seed


def replay() -> str:
    return f"replay: FLASHLADDER_SEED={run_seed()}"


def make_inputs(batch, heads, seqlen_q, seqlen_k, *, factor=1.0, seed=None, device="cuda", heads_k=None,
                dtype=torch.bfloat16, head_dim=HEAD_DIM):
    """q, k, v bf16 (or dtype: fp16) ~ factor * N(INPUT_MEAN, 1) in torch's [batch, heads, seqlen, head_dim] layout
    (seed: run_seed()); heads_k: k and v's heads (default: heads), for grouped (GQA) or multi-query (heads_k = 1)
    attention."""
    gen = torch.Generator(device="cpu").manual_seed(run_seed() if seed is None else seed)
    heads_k = heads if heads_k is None else heads_k
    def one(h, n):
        return (factor * (torch.randn(batch, h, n, head_dim, generator=gen) + INPUT_MEAN)).to(dtype).to(device)
    return one(heads, seqlen_q), one(heads_k, seqlen_k), one(heads_k, seqlen_k)


def check_causal(causal):
    """causal as the checks take it: False (None too), "top_left" or "bottom_right" (verify/reference.py)."""
    if causal is None or causal is False:
        return False
    causal_offset(0, 0, causal)  # raises for anything else
    return causal


@contextlib.contextmanager
def ieee_fp32_matmul():
    """fp32 matmuls in true fp32 (no TF32) inside, whatever the caller chose; restored after."""
    flags = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "ieee") if hasattr(flags, "fp32_precision") else ("allow_tf32", False)  # torch >= 2.9
    old = getattr(flags, name)
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, old)


def yardstick_attention(q, k, v, scale, causal=False):
    """Attention in the kernels' precision class, on q's device: the bf16 (or fp16) inputs' products are exact in
    fp32, so scores = fp32 GEMM (fp32 accumulation, no TF32); P = exp(s - rowmax) in fp32, rounded to q's dtype for
    P.V (fp32 accumulation); the row sum l from the unrounded fp32 P; O = acc / l rounded to q's dtype; LSE = rowmax +
    log(l).
    causal: the scores of the keys a row does not see are -inf (P = 0); a row that sees none gets o = 0 and
    lse = -inf. k, v may have fewer heads than q (a divisor): query head h reads key/value head h // (heads // heads_k).
    Computed in blocks of query rows of at most CHUNK_SCORES scores, as the float64 reference is.
    Returns (o in q's dtype, lse fp32)."""
    causal = check_causal(causal)
    heads, heads_k = q.shape[1], k.shape[1]
    if heads_k != heads:
        if heads_k == 0 or heads % heads_k:
            raise ValueError(f"{heads_k} key/value heads do not divide {heads} query heads")
        k, v = (t.repeat_interleave(heads // heads_k, dim=1) for t in (k, v))
    nq, nk = q.shape[2], k.shape[2]
    block = max(1, CHUNK_SCORES // max(1, q.shape[0] * heads * nk))
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    with ieee_fp32_matmul():
        for start in range(0, nq, block):
            stop = min(nq, start + block)
            s = torch.matmul(q[:, :, start:stop].float(), kf.transpose(-1, -2)) * scale
            if causal:
                i = torch.arange(start, stop, device=q.device)[:, None]
                j = torch.arange(nk, device=q.device)[None, :]
                s = s.masked_fill(j > i + causal_offset(nq, nk, causal), -math.inf)
            m = s.amax(dim=-1, keepdim=True) if nk else s.new_full((*s.shape[:-1], 1), -math.inf)
            keyless = torch.isneginf(m)  # rows that see no key
            p = torch.exp(s - torch.where(keyless, 0.0, m))  # exp(-inf) = 0 for every key such a row does not see
            row_sum = p.sum(dim=-1, keepdim=True)
            acc = torch.matmul(p.to(q.dtype).float(), vf)
            o[:, :, start:stop] = torch.where(keyless, 0.0, acc / torch.where(keyless, 1.0, row_sum)).to(q.dtype)
            lse[:, :, start:stop] = torch.where(keyless, -math.inf, m + torch.log(row_sum)).squeeze(-1)
    return o, lse


@dataclass
class Errors:
    o_rel_frob: float
    o_max_abs: float
    o_max_abs_yardstick: float
    lse_max_abs: float
    lse_max_abs_yardstick: float
    lse_max_abs_ref: float  # the largest |LSE|, which sets the fp32 floor
    nonfinite_o: int
    nonfinite_lse: int
    o_at: tuple = ()        # [batch, head, row, dim] of the O error nearest its own bound (NOT always the
                            # largest error: o_max_abs is the error there, checked against o_limit() there)
    o_ref_abs_at: float = 0.0  # |O_ref| at o_at: its O_P_ROUNDING allowance
    lse_at: tuple = ()      # [batch, head, row] of the largest LSE error
    wrong_keyless: int = 0  # rows that see no key (lse_ref = -inf) whose o is not all 0 or whose lse is not -inf
    keyless_at: tuple = ()  # [batch, head, row] of the first of them
    o_p_rounding: float = O_P_ROUNDING  # p_rounding_of the inputs' dtype
    o_rel_frob_limit: float = O_REL_FROB  # rel_frob_of the inputs' dtype

    def o_limit(self) -> float:
        return O_YARDSTICK_FACTOR * self.o_max_abs_yardstick + self.o_p_rounding * self.o_ref_abs_at + O_ATOL

    def lse_limit(self) -> float:
        return LSE_YARDSTICK_FACTOR * self.lse_max_abs_yardstick + LSE_ULPS * 2.0**-23 * self.lse_max_abs_ref

    def failures(self) -> list[str]:
        bad = []
        if self.wrong_keyless:
            bad.append(f"{self.wrong_keyless} rows that see no key have o != 0 or lse != -inf (the first at "
                       f"{list(self.keyless_at)})")
        if self.nonfinite_o or self.nonfinite_lse:
            bad.append(f"{self.nonfinite_o} non-finite O and {self.nonfinite_lse} non-finite LSE elements "
                       "(NaN-poisoned outputs not written, or NaN/Inf computed)")
        if not self.o_rel_frob <= self.o_rel_frob_limit:  # `not <=` so that NaN fails
            bad.append(f"O relative Frobenius error {self.o_rel_frob:.3g} > {self.o_rel_frob_limit:g}")
        if not self.o_max_abs <= self.o_limit():
            bad.append(f"O error {self.o_max_abs:.3g} at {list(self.o_at)} > {O_YARDSTICK_FACTOR:g} x the yardstick's max "
                       f"({self.o_max_abs_yardstick:.3g}) + {self.o_p_rounding:.3g} x |O_ref| there ({self.o_ref_abs_at:.3g}) + "
                       f"{O_ATOL:g} = {self.o_limit():.3g}")
        if not self.lse_max_abs <= self.lse_limit():
            bad.append(f"LSE max abs error {self.lse_max_abs:.3g} at {list(self.lse_at)} > {LSE_YARDSTICK_FACTOR:g} x the "
                       f"yardstick's ({self.lse_max_abs_yardstick:.3g}) + {LSE_ULPS:g} fp32 ulp of max|LSE| "
                       f"({self.lse_max_abs_ref:.3g}) = {self.lse_limit():.3g}")
        return bad


@dataclass
class Case:
    """Inputs of a check and what the verdict on any step's outputs for them needs: the float64 reference and
    the yardstick's errors. Neither depends on the step, so one case serves every step."""
    label: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    o_ref: np.ndarray
    lse_ref: np.ndarray
    o_yardstick: float
    lse_yardstick: float
    causal: object = False  # False, "top_left" or "bottom_right" (k, v's heads are in their shape)
    p_rounding: float = O_P_ROUNDING  # p_rounding_of the inputs' dtype
    rel_frob: float = O_REL_FROB      # rel_frob_of the inputs' dtype


def _abs_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want|, with 0 where both are -inf (the LSE of a row that sees no key, exact); -inf against a
    finite value is an infinite error, NaN anywhere a NaN error."""
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    err[np.isneginf(got) & np.isneginf(want)] = 0.0
    return err


def _max_abs(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.max(_abs_errors(got.double().cpu().numpy(), want), initial=0.0))


def prepare(q, k, v, scale=None, label="", cache_key=None, causal=False) -> Case:
    """A Case for these inputs: the float64 reference in torch on the GPU where the inputs are there
    (attention_reference_torch: milliseconds), else with numpy (cache_key: kept on disk for the other processes of the
    run, which would compute it again). causal: False, "top_left" or "bottom_right"; k, v may have fewer heads than q
    (a divisor of its heads). scale: 1/sqrt(head dim) by default, as the steps' own."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    causal = check_causal(causal)
    if q.device.type == "cuda":
        o_ref, lse_ref = attention_reference_torch(q, k, v, scale, causal)
    else:
        as64 = [t.double().cpu().numpy() for t in (q, k, v)]
        o_ref, lse_ref = (_cached_reference(cache_key, as64, scale, causal) if cache_key
                          else attention_reference_of(*as64, scale, causal))
    o_y, lse_y = yardstick_attention(q, k, v, scale, causal)
    return Case(label, q, k, v, scale, o_ref, lse_ref, _max_abs(o_y, o_ref), _max_abs(lse_y, lse_ref), causal,
                p_rounding_of(q.dtype), rel_frob_of(q.dtype))


def errors_of(case: Case, o: torch.Tensor, lse: torch.Tensor) -> Errors:
    """The errors of outputs (o, lse) of case's inputs, beside the yardstick's. Where a row sees no key (the
    reference's lse is -inf), o must be 0 and lse -inf exactly (wrong_keyless counts the rows that are not); an
    lse of -inf there is no error and not non-finite."""
    o64, lse64 = o.double().cpu().numpy(), lse.double().cpu().numpy()
    keyless = np.isneginf(case.lse_ref)
    exact_keyless = keyless & np.isneginf(lse64)  # an lse of -inf where the reference has it
    wrong_keyless = keyless & ~(exact_keyless & (o64 == 0).all(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        o_err, lse_err = np.abs(o64 - case.o_ref), _abs_errors(lse64, case.lse_ref)
        o_at = np.unravel_index(np.argmax(o_err - case.p_rounding * np.abs(case.o_ref)), o_err.shape)  # a NaN first
        finite_lse = np.abs(case.lse_ref[np.isfinite(case.lse_ref)])
        ref_norm, err_norm = np.linalg.norm(case.o_ref), np.linalg.norm(o64 - case.o_ref)
        return Errors(
            # (every row keyless: o_ref = 0, and the error must be 0 too)
            o_rel_frob=float(err_norm / ref_norm if ref_norm > 0 else 0.0 if err_norm == 0 else math.inf),
            o_max_abs=float(o_err[o_at]),
            o_max_abs_yardstick=case.o_yardstick,
            lse_max_abs=float(np.max(lse_err)),
            lse_max_abs_yardstick=case.lse_yardstick,
            lse_max_abs_ref=float(finite_lse.max(initial=0.0)),
            nonfinite_o=int((~np.isfinite(o64)).sum()),
            nonfinite_lse=int((~np.isfinite(lse64) & ~exact_keyless).sum()),
            o_at=tuple(int(i) for i in o_at),
            o_ref_abs_at=float(abs(case.o_ref[o_at])),
            lse_at=tuple(int(i) for i in np.unravel_index(np.argmax(lse_err), lse_err.shape)),
            wrong_keyless=int(wrong_keyless.sum()),
            keyless_at=tuple(int(i[0]) for i in np.nonzero(wrong_keyless)) if wrong_keyless.any() else (),
            o_p_rounding=case.p_rounding,
            o_rel_frob_limit=case.rel_frob,
        )


def run_poisoned(mod, q, k, v, scale=None, causal=False):
    """Call the step writing into NaN-poisoned buffers; returns (o, lse). causal goes to the step only when it is
    asked for (a step without causal masks takes causal=False too)."""
    o = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    mod.attention_out(q, k, v, o, lse, scale, **({"causal": causal} if causal else {}))
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    return o, lse


def check(mod, case: Case) -> Errors:
    return errors_of(case, *run_poisoned(mod, case.q, case.k, case.v, case.scale, case.causal))


def measure_errors(mod, q, k, v, scale=None, causal=False) -> Errors:
    """One call of the step on (q, k, v), judged against a fresh reference."""
    return check(mod, prepare(q, k, v, scale, causal=causal))


# ---------------------------------------------------------------- cases shared by every step of a run

@functools.lru_cache(maxsize=None)
def random_case(batch, heads, seqlen_q, seqlen_k, factor=1.0, causal=False, heads_k=None, dtype=torch.bfloat16,
                head_dim=HEAD_DIM) -> Case:
    """make_inputs(...) of this run's seed, prepared once per process (on the CPU, its numpy reference once per run).
    causal: False, "top_left" or "bottom_right"; heads_k: k and v's heads (default: heads); dtype, head_dim: the
    inputs'."""
    key = ("random", batch, heads, seqlen_q, seqlen_k, factor, causal, heads_k, str(dtype), head_dim)
    label = (f"random x{factor:g} {batch}x{heads}x{seqlen_q}x{seqlen_k}" + (f", {heads_k} kv heads" if heads_k else "")
             + (f", causal {causal}" if causal else "") + (f", {dtype}" if dtype != torch.bfloat16 else "")
             + (f", head dim {head_dim}" if head_dim != HEAD_DIM else ""))
    return prepare(*make_inputs(batch, heads, seqlen_q, seqlen_k, factor=factor, heads_k=heads_k, dtype=dtype,
                                head_dim=head_dim),
                   label=label, cache_key=key, causal=causal)


# The numpy model's adversarial value cases (verify/tests/test_model.py), built from bf16 inputs because the
# kernels take no mask: a per-key bias of the scores comes from the inputs themselves (adversarial_inputs).
ADVERSARIAL = {
    "max_grows_every_tile": "the row max grows in every K tile (+1 nat per tile): O and l rescaled after every tile",
    "max_in_last_tile_by_3": "every row's max only in the last K tile, 3 nats up: earlier tiles still count, rescaled",
    "max_in_last_tile_by_30": "every row's max only in the last K tile, 30 nats up: earlier tiles rescaled to ~0",
    # The same three, mirrored: a step that visits the last K/V tile first (step14: n-1, 0, 1, ..., n-2) meets
    # the jumps of these, and not those of the three above.
    "max_shrinks_every_tile": "the row max shrinks in every K tile (-1 nat per tile): the max comes from key tile 0",
    "max_in_first_tile_by_3": "every row's max only in K tile 0, 3 nats up: tiles visited before it rescaled",
    "max_in_first_tile_by_30": "every row's max only in K tile 0, 30 nats up: tiles visited before it rescaled to ~0",
    "one_dominant_key_first": "key 0 dominates every row by ~30 nats: O = its V row",
    "one_dominant_key_last": "the last key dominates every row by ~30 nats: O = its V row",
    "equal_logits": "all keys equal, so every score of a row is equal: O = mean of V",
    "large_v_mean": "V ~ 100 + N(0, 1): O near 100, where a bf16 ulp is 0.5",
}
ADVERSARIAL_K_TILES = 8
DOMINANCE = 30.0  # nats: weight e^-30 ~ 1e-13 for every other key, invisible in bf16
# Cases for causal calls (adversarial_case(kind, ..., causal="top_left" or "bottom_right")), of the same shapes.
CAUSAL_ADVERSARIAL = {
    "masked_keys_above_by_100": "in every K tile the scores climb 100 nats from its first key to its last, so that in a "
                                "row's diagonal tile the keys it does not see score above the ones it sees, by up to "
                                "100 nats: a max taken before the mask underflows every key the row sees (top_left: "
                                "the first rows see their diagonal tile alone, and no row sees the last 6 K tiles)",
}
MASKED_DOMINANCE = 100.0  # nats: e^-100 is below fp32's smallest normal number (e^-87.3)


def adversarial_inputs(kind, tile_q, tile_k, seed=None, device="cuda", dtype=torch.bfloat16, head_dim=HEAD_DIM):
    """q, k, v (bf16 or dtype, [1, 2, 2 tile_q, ADVERSARIAL_K_TILES tile_k, head_dim]) for one of ADVERSARIAL (or
    CAUSAL_ADVERSARIAL).

    The bias cases put q ~ 1 + N(0, 1/16) (every row summing to d, the head dim) and k_j = bias_j / (d scale) + N(0, 1/100),
    so that score(i, j) ~ bias_j (nats) + a random part of ~0.1 nat. Every term of a dot product is then of
    the same size, as in real inputs: no huge term beside tiny ones, which would test the tensor cores'
    accumulation more than the kernel.
    """
    if kind not in ADVERSARIAL and kind not in CAUSAL_ADVERSARIAL:
        raise ValueError(f"unknown adversarial case {kind!r}; one of {', '.join([*ADVERSARIAL, *CAUSAL_ADVERSARIAL])}")
    gen = torch.Generator(device="cpu").manual_seed(run_seed() if seed is None else seed)
    nq, nk = 2 * tile_q, ADVERSARIAL_K_TILES * tile_k
    def randn(n):
        return torch.randn(1, 2, n, head_dim, generator=gen)
    q, k, v = randn(nq) + INPUT_MEAN, randn(nk) + INPUT_MEAN, randn(nk) + INPUT_MEAN
    key = torch.arange(nk, dtype=torch.float32)
    bias = {
        "max_grows_every_tile": key / tile_k,
        "max_in_last_tile_by_3": 3.0 * (key >= nk - tile_k),
        "max_in_last_tile_by_30": 30.0 * (key >= nk - tile_k),
        "max_shrinks_every_tile": (nk - 1 - key) / tile_k,
        "max_in_first_tile_by_3": 3.0 * (key < tile_k),
        "max_in_first_tile_by_30": 30.0 * (key < tile_k),
        "one_dominant_key_first": DOMINANCE * (key == 0),
        "one_dominant_key_last": DOMINANCE * (key == nk - 1),
        "masked_keys_above_by_100": MASKED_DOMINANCE * (key % tile_k) / max(1, tile_k - 1),
    }.get(kind)
    if bias is not None:
        noise = 0.25 * randn(nq)
        q = 1.0 + noise - noise.mean(dim=-1, keepdim=True)  # every row sums to d: the same bias for every row
        k = bias[:, None] / (head_dim * default_scale(head_dim)) + 0.1 * randn(nk)
    elif kind == "equal_logits":
        k = k[:, :, :1].expand(k.shape).clone()
    elif kind == "large_v_mean":
        v = 100.0 + randn(nk)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


@functools.lru_cache(maxsize=None)
def adversarial_case(kind, tile_q, tile_k, causal=False, dtype=torch.bfloat16, head_dim=HEAD_DIM) -> Case:
    return prepare(*adversarial_inputs(kind, tile_q, tile_k, dtype=dtype, head_dim=head_dim),
                   label=f"{kind} (tiles {tile_q}x{tile_k}" + (f", causal {causal}" if causal else "")
                   + (f", {dtype}" if dtype != torch.bfloat16 else "")
                   + (f", head dim {head_dim})" if head_dim != HEAD_DIM else ")"),
                   cache_key=("adversarial", kind, tile_q, tile_k, causal, str(dtype), head_dim), causal=causal)


# ---------------------------------------------------------------- the numpy reference, once per run

CACHE_DIR = Path(__file__).resolve().parent.parent / "build" / "reference-cache"
# The code that makes the inputs and the reference: a change to either makes the cached files stale.
_SOURCE = hashlib.sha256(b"".join((Path(__file__).parent / f).read_bytes() for f in ("checks.py", "reference.py"))).hexdigest()


def _cached_reference(key: tuple, qkv64: list, scale: float, causal=False):
    """attention_reference_of(*qkv64, scale, causal), kept in build/reference-cache for the other steps of this run
    (each step's checks may run in a process of its own; numpy's reference is slow at long sequences). Files of
    other seeds are removed when one is written: the cache holds one run. The file's name covers the causal mask
    and the inputs' shapes (k/v's heads with them) besides `key`, whatever `key` says."""
    seed = run_seed()
    shapes = tuple(tuple(x.shape) for x in qkv64)
    name = hashlib.sha256(repr((key, scale, causal, shapes, _SOURCE)).encode()).hexdigest()[:32]
    path = CACHE_DIR / f"{seed}-{name}.npz"
    try:
        with np.load(path) as f:
            return f["o"], f["lse"]
    except (OSError, KeyError, ValueError):  # not there yet (or half written by a process that died)
        pass
    o, lse = attention_reference_of(*qkv64, scale, causal)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    for old in CACHE_DIR.glob("*.npz"):
        if not old.name.startswith(f"{seed}-"):
            old.unlink(missing_ok=True)
    tmp = CACHE_DIR / f"{seed}-{name}.{os.getpid()}.tmp.npz"
    np.savez(tmp, o=o, lse=lse)
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return o, lse


# ---------------------------------------------------------------- wrong outputs the verdict must reject (tests)

# Each changes ONE row of ONE head (or one LSE entry) of a correct output, where |O_ref| is largest, and names
# the failure it must cause. Scaling a row by 1 + 2^-5 and rounding back to bf16 moves O there by at least
# ~7 x 2^-8 |O|; the bound allows at most 3 x 2^-8 |O| (2x the yardstick's half ulp of bf16 rounding, <= 2^-8 |O|
# each, + O_P_ROUNDING), and a correct output's own error there is at most ~2 x 2^-8 |O| (one P rounding, then
# half an ulp), so the verdict keeps room. (It was 1 + 2^-6 before O_P_ROUNDING, against a bound of up to
# 2 x 2^-8 |O|.) The LSE error is that of a row sum l off by 1/256 (one of 256 equal keys dropped): ~4e-3,
# still several times the bound at x10, where |LSE| ~ 1e3.
CORRUPTIONS = {
    "O row scaled by 1 + 2^-5": "O error",  # a wrong l for one row: 3% off
    "O row from the next query": "O error",  # a row written to the wrong place
    "O element NaN": "non-finite",
    "LSE entry + log(1 + 2^-8)": "LSE max abs error",
    "LSE entry NaN": "non-finite",
}


def corrupted(kind: str, case: Case, o: torch.Tensor, lse: torch.Tensor):
    """Copies of (o, lse) with the corruption `kind` (one of CORRUPTIONS) applied."""
    o, lse = o.clone(), lse.clone()
    b, h, i, d = np.unravel_index(np.argmax(np.abs(case.o_ref)), case.o_ref.shape)
    if kind == "O row scaled by 1 + 2^-5":
        o[b, h, i] = (o[b, h, i].float() * (1 + 2**-5)).to(o.dtype)
    elif kind == "O row from the next query":
        # The next query whose output differs: with peaked rows (inputs x10) neighbours may attend to the same key and
        # have the same O, and a copy of an equal row is no corruption at all.
        n, row = o.shape[2], case.o_ref[b, h, i]
        far = [j for j in (*range(i + 1, n), *range(i - 1, -1, -1))
               if np.abs(case.o_ref[b, h, j] - row).max() > 2**-4 * np.abs(row).max()]
        o[b, h, i] = o[b, h, far[0] if far else (i + 1 if i + 1 < n else i - 1)]
    elif kind == "O element NaN":
        o[b, h, i, d] = math.nan
    elif kind == "LSE entry + log(1 + 2^-8)":
        lse[b, h, i] += math.log1p(2**-8)
    elif kind == "LSE entry NaN":
        lse[b, h, i] = math.nan
    else:
        raise ValueError(f"unknown corruption {kind!r}; one of {', '.join(CORRUPTIONS)}")
    return o, lse
