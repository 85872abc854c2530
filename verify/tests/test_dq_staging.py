"""CPU: where the backward's dQ goes, from a consumer thread's registers to the fp32 accumulator, modelled from the
final step's own expressions (read from its kernel.cu: the model fails if they change) and TMA's 128-byte swizzle
(verify/tests/test_descriptors.py checks that model against the hardware's pattern). At head dim 128 each element of a
query tile's dQ arrives once; at 64 (step42) twice, once from each consumer warpgroup's partial, and nothing anywhere
else: no element lost, none added to the wrong column."""
import collections
import re
from pathlib import Path

import pytest

from verify import steps as steps_mod

ROOT = Path(__file__).resolve().parents[2]
WARPGROUPS, WARPS, QUERIES, BOX_COLS = 2, 4, 80, 32  # consumer warpgroups, warps each; a tile's queries; floats a box row

# The expressions the model follows, as the kernel writes them (stage_dq and the reducer of bwd_dkdv_kernel).
STAGED_AT = "t.dq_stage[dim / 32 * DQ_BOX_FLOATS + query * 32 + chunk * 4 + dim % 4] = dqt[nb][r];"
CHUNK = "const int chunk = (dim % 32 / 4) ^ (query % 8);"
DIM0 = "const int dim0 = wg * 64 + warp % 4 * 16 + g;"
ELEMENT = "const int dim = dim0 + 8 * (r / 2), query = nb * 8 + 2 * tq + r % 2;"
REDUCED_TO = "cp_reduce_async_bulk_tensor_4d_add(&dQ_map, box % (D / 32) * 32, q0, h, b, t.dq_stage + box * DQ_BOX_FLOATS);"


def final_kernel() -> str:
    step = steps_mod.all_steps()[-1]
    return (ROOT / "steps" / step / "kernel.cu").read_text()


def model(head_dim: int, reduced_to=lambda box, d: box % (d // 32) * 32, staged_box=lambda dim: dim // 32):
    """(landed, overwritten) for one query tile: landed = {(query, column of the accumulator): how many additions land
    there}, following every consumer thread's every dQ^T register through the staging tile (its float index: box,
    row = query, and the 16-byte chunk XORed with the row, as STAGED_AT and CHUNK say) and TMA's reduction of each box,
    which undoes the swizzle (SWIZZLE_128B: the chunk's bits XORed with the row's within the 1024-byte atom) and adds
    the box's row into the accumulator's columns from REDUCED_TO's; overwritten = staged floats written twice (one
    thread's value lost)."""
    box_floats = QUERIES * BOX_COLS
    staged = collections.Counter()
    for wg in range(WARPGROUPS):
        for warp in range(WARPS):
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                dim0 = wg * 64 + warp % 4 * 16 + g
                for nb in range(QUERIES // 8):
                    for r in range(4):
                        dim, query = dim0 + 8 * (r // 2), nb * 8 + 2 * tq + r % 2
                        chunk = (dim % 32 // 4) ^ (query % 8)
                        staged[staged_box(dim) * box_floats + query * 32 + chunk * 4 + dim % 4] += 1
    landed = collections.Counter()
    for index in staged:  # what the reducer adds: each staged float once, wherever it was written from
        box, within = divmod(index, box_floats)
        row, col = divmod(within, BOX_COLS)
        byte = row * 128 + col * 4
        byte ^= ((byte >> 7) % 8) << 4  # TMA reads the box through the same swizzle
        assert byte // 128 == row
        landed[row, reduced_to(box, head_dim) + (byte % 128) // 4] += 1
    return landed, sum(n - 1 for n in staged.values())


def test_the_model_follows_the_final_step_s_expressions():
    source = re.sub(r"\s+", " ", final_kernel())
    for expression in (STAGED_AT, CHUNK, DIM0, ELEMENT, REDUCED_TO):
        assert re.sub(r"\s+", " ", expression) in source, f"the kernel no longer reads: {expression}"


@pytest.mark.parametrize("head_dim, times", [(128, 1), (64, 2)])
def test_every_element_of_dq_lands_in_its_column(head_dim, times):
    landed, overwritten = model(head_dim)
    assert overwritten == 0, f"{overwritten} staged floats written twice"
    assert set(landed) == {(q, c) for q in range(QUERIES) for c in range(head_dim)}, "an element lost or misplaced"
    assert set(landed.values()) == {times}, collections.Counter(landed.values())


def test_the_model_catches_a_wrong_column_or_box():
    """The check bites: at 64 without the modulo (every box to its own column, as at 128) the second partial lands past
    the head dim; both warpgroups staged into the same two boxes overwrite each other's partial."""
    landed, _ = model(64, reduced_to=lambda box, d: box * 32)
    assert any(c >= 64 for _, c in landed)
    landed, overwritten = model(64, staged_box=lambda dim: dim % 64 // 32)
    assert overwritten == QUERIES * 64 and set(landed.values()) == {1}
