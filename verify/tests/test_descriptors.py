"""CPU: the bit layouts that the Hopper steps hand to the hardware, against encodings written here from the specs.

* wgmma's shared-memory matrix descriptor, common/wgmma.cuh `wgmma_desc`, against the PTX ISA's field table
  ("Asynchronous Warpgroup Level Matrix Shared Memory Layout: Matrix Descriptor Format").
* TMA's 128-byte swizzle as the steps address it, common/swizzle.cuh `swizzle_tma_128b<ROWS>`, against the
  hardware's definition: the TMA unit writes each [ROWS, 64] bf16 box (128-byte rows) with address bits 4-6
  XORed with bits 7-9 (CUDA C++ Programming Guide, "Tensor Memory Access": the swizzle patterns).
Both C++ functions are compiled into small host programs and run here; no GPU is needed. The meta-tests show
that a wrong encoding (each field moved or narrowed by one bit, a wrong swizzle pattern) is caught by the
inputs used.
"""
from __future__ import annotations

import random
import subprocess

import pytest

from verify import steps as steps_mod

build_step = steps_mod.build_step

# ---- wgmma descriptor ----
# PTX ISA, matrix descriptor format: field -> (lowest bit, width in bits). Addresses and offsets are encoded as
# "matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4": bits 4-17 of the byte value.
FIELDS = {"start_address": (0, 14), "leading_byte_offset": (16, 14), "stride_byte_offset": (32, 14),
          "base_offset": (49, 3), "swizzle": (62, 2)}
SWIZZLE_MODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
ADDRESS_LOW_BITS = 4  # the encoding drops the 16-byte offset: operands are 16-byte aligned


def encoded(byte_value: int, width: int, low_bits: int = ADDRESS_LOW_BITS) -> int:
    """Bits [low_bits, low_bits + width) of a byte address or offset."""
    return (byte_value >> low_bits) % (1 << width)


def descriptor(addr: int, lbo: int, sbo: int, swizzle: int, fields=FIELDS, low_bits: int = ADDRESS_LOW_BITS) -> int:
    """The 64-bit descriptor, assembled field by field from the table (base offset 0: atoms 1024-byte aligned)."""
    values = {"start_address": addr, "leading_byte_offset": lbo, "stride_byte_offset": sbo}
    desc = 0
    for name, (lo, width) in fields.items():
        if name in values:
            value = encoded(values[name], width, low_bits)
        else:
            value = {"base_offset": 0, "swizzle": swizzle}[name]
        assert 0 <= value < 1 << width, f"{name} = {value} does not fit in {width} bits"
        desc |= value << lo
    return desc


DESC_PROGRAM = """
#include <cstdio>
#include "wgmma.cuh"
// wgmma_desc is constexpr: the steps may build descriptors at compile time.
static_assert(wgmma_desc(0, 0, 0, 0) == 0, "wgmma_desc is usable in constant expressions");
int main() {  // each input line: addr lbo sbo swizzle; each output line: the descriptor in hex
    unsigned addr, lbo, sbo, swizzle;
    while (std::scanf("%u %u %u %u", &addr, &lbo, &sbo, &swizzle) == 4)
        std::printf("%016llx\\n", (unsigned long long)wgmma_desc(addr, lbo, sbo, swizzle));
}
"""


def compile_host_program(tmp_path, name: str, source: str, as_cuda: bool = True) -> str:
    """nvcc, for sm_90a like the steps (the headers' device code must compile for it); the host code runs here."""
    src = tmp_path / (name + (".cu" if as_cuda else ".cpp"))
    exe = tmp_path / name
    src.write_text(source)
    cmd = [build_step.find_nvcc(), "-std=c++17", *build_step.ARCH_FLAGS, f"-I{build_step.COMMON}", str(src), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return str(exe)


def field_boundaries() -> list[int]:
    """Byte values at the edges of a 14-bit field encoded from bits 4-17, derived from the table."""
    width = FIELDS["start_address"][1]
    top = 1 << (width + ADDRESS_LOW_BITS)  # the first byte value the field cannot hold (256 KB)
    middle = 1 << (ADDRESS_LOW_BITS + width // 2)  # one bit in the middle of the field
    return [0, 1, 15, 16, 17, middle, top - 16, top - 1, top, top + 16, 2 * top - 16, 2**32 - 1]


def descriptor_inputs() -> list[tuple[int, int, int, int]]:
    """Every field at its boundaries (the others holding distinct values), every swizzle mode, and random inputs."""
    rng = random.Random(20261129)
    inputs = []
    for edge in field_boundaries():
        for swizzle in SWIZZLE_MODES.values():
            inputs += [(edge, 16, 1024, swizzle), (1024, edge, 16, swizzle), (16, 1024, edge, swizzle),
                       (edge, edge, edge, swizzle)]
    inputs += [(rng.randrange(2**32), rng.randrange(2**32), rng.randrange(2**32), rng.randrange(len(SWIZZLE_MODES)))
               for _ in range(500)]
    return inputs


@pytest.fixture(scope="module")
def cpp_descriptors(tmp_path_factory):
    """{input: the descriptor common/wgmma.cuh builds for it}."""
    exe = compile_host_program(tmp_path_factory.mktemp("desc"), "desc", DESC_PROGRAM)
    inputs = descriptor_inputs()
    out = subprocess.run([exe], input="".join(" ".join(map(str, inp)) + "\n" for inp in inputs), capture_output=True,
                         text=True, check=True).stdout.split()
    assert len(out) == len(inputs), f"the program printed {len(out)} descriptors for {len(inputs)} inputs"
    return {inp: int(h, 16) for inp, h in zip(inputs, out)}


def mismatches(cpp: dict, encode) -> list[str]:
    return [f"wgmma_desc{inp} = {got:#018x}, the PTX ISA's layout gives {encode(*inp):#018x}"
            for inp, got in cpp.items() if got != encode(*inp)]


def test_wgmma_descriptor_matches_the_ptx_isa(cpp_descriptors):
    bad = mismatches(cpp_descriptors, descriptor)
    assert not bad, f"{len(bad)} of {len(cpp_descriptors)} descriptors differ, e.g.:\n" + "\n".join(bad[:5])


def wrong_tables():
    """Each field of the table one bit too low, one bit too high, or one bit narrower: an encoding error each."""
    for name, (lo, width) in FIELDS.items():
        for wrong in ((lo - 1, width), (lo + 1, width), (lo, width - 1)):
            if wrong[0] >= 0 and wrong[1] > 0 and (name != "base_offset"):  # base offset is 0: no input shows its place
                yield f"{name}-bit{wrong[0]}-width{wrong[1]}", {**FIELDS, name: wrong}


@pytest.mark.parametrize("label, table", list(wrong_tables()), ids=[label for label, _ in wrong_tables()])
def test_a_wrong_field_layout_is_caught(cpp_descriptors, label, table):
    def wrong(*inp):
        try:
            return descriptor(*inp, fields=table)
        except AssertionError:  # a value that does not fit the narrowed field: an encoding that differs
            return -1
    assert mismatches(cpp_descriptors, wrong), f"a descriptor table with {label} went unnoticed by the inputs"


@pytest.mark.parametrize("low_bits", [ADDRESS_LOW_BITS - 1, ADDRESS_LOW_BITS + 1, 0])
def test_a_wrong_address_encoding_is_caught(cpp_descriptors, low_bits):
    bad = mismatches(cpp_descriptors, lambda *inp: descriptor(*inp, low_bits=low_bits))
    assert bad, f"encoding addresses from bit {low_bits} instead of bit {ADDRESS_LOW_BITS} went unnoticed"


# ---- TMA's 128-byte swizzle ----
# swizzle_tma_128b is __device__ only; the header is plain C++ otherwise, so the host program compiles it with
# the CUDA keywords defined away (the formula, not a copy of it).
SWIZZLE_PROGRAM = """
#define __device__
#define __forceinline__ inline
#include <cstdio>
#include "swizzle.cuh"
template <int ROWS>
void dump() {  // ROWS, then the element offset of (row, col) for every row and column of a [ROWS, 128] tile
    std::printf("%d\\n", ROWS);
    for (int row = 0; row < ROWS; ++row)
        for (int col = 0; col < 128; ++col) std::printf("%d\\n", swizzle_tma_128b<ROWS>(row, col));
}
int main() { %s }
"""
TILE_ROWS = (64, 128)  # the steps' tile heights: BLOCK_N of step08, BLOCK_M and BLOCK_N of steps 09+
ELEM_BYTES = 2         # bf16
BOX_COLS = 64          # a TMA box row: 64 bf16 = 128 bytes, the widest row the 128-byte swizzle takes
CHUNK_BITS, ROW_BITS = (4, 7), (7, 10)  # SWIZZLE_128B: bits [4, 7) (16-byte chunk) ^= bits [7, 10) (row in an atom)


def tma_swizzled_offset(rows: int, row: int, col: int, chunk_bits=CHUNK_BITS, row_bits=ROW_BITS, box_cols=BOX_COLS) -> int:
    """Element offset where TMA puts (row, col) of a [rows, HEAD_DIM] tile loaded as boxes of `box_cols` columns,
    box h = col // box_cols at byte h * rows * box_cols * 2, into a 1024-byte aligned tile."""
    box, col_in_box = divmod(col, box_cols)
    byte = box * rows * box_cols * ELEM_BYTES + row * box_cols * ELEM_BYTES + col_in_box * ELEM_BYTES
    (c_lo, c_hi), (r_lo, r_hi) = chunk_bits, row_bits
    row_field = (byte >> r_lo) % (1 << (r_hi - r_lo))
    byte ^= (row_field % (1 << (c_hi - c_lo))) << c_lo
    return byte // ELEM_BYTES


@pytest.fixture(scope="module")
def cpp_swizzle(tmp_path_factory):
    """{rows: {(row, col): element offset from common/swizzle.cuh}}."""
    assert all(r % 8 == 0 for r in TILE_ROWS)
    source = SWIZZLE_PROGRAM.replace("%s", " ".join(f"dump<{r}>();" for r in TILE_ROWS))
    exe = compile_host_program(tmp_path_factory.mktemp("swz"), "swz", source, as_cuda=False)
    numbers = [int(x) for x in subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split()]
    head_dim = 2 * BOX_COLS
    out, i = {}, 0
    while i < len(numbers):
        rows = numbers[i]
        cells = numbers[i + 1:i + 1 + rows * head_dim]
        out[rows] = {(r, c): cells[r * head_dim + c] for r in range(rows) for c in range(head_dim)}
        i += 1 + rows * head_dim
    assert sorted(out) == sorted(TILE_ROWS)
    return out


def swizzle_mismatches(cpp: dict, model) -> list[str]:
    return [f"swizzle_tma_128b<{rows}>{rc} = {got}, TMA puts it at {model(rows, *rc)}"
            for rows, table in cpp.items() for rc, got in table.items() if got != model(rows, *rc)]


def test_tma_swizzle_matches_the_hardware_pattern(cpp_swizzle):
    bad = swizzle_mismatches(cpp_swizzle, tma_swizzled_offset)
    assert not bad, f"{len(bad)} elements misplaced, e.g.:\n" + "\n".join(bad[:5])


@pytest.mark.parametrize("label, model", [
    ("row bits 8-10 instead of 7-9", lambda r, i, j: tma_swizzled_offset(r, i, j, row_bits=(8, 11))),
    ("XOR of 2 row bits only", lambda r, i, j: tma_swizzled_offset(r, i, j, row_bits=(7, 9))),
    ("no swizzle", lambda r, i, j: tma_swizzled_offset(r, i, j, row_bits=(7, 7))),
    ("one 256-byte box per row (no halves)", lambda r, i, j: tma_swizzled_offset(r, i, j, box_cols=128)),
], ids=["row-bits-shifted", "two-row-bits", "no-swizzle", "no-halves"])
def test_a_wrong_swizzle_model_is_caught(cpp_swizzle, label, model):
    assert swizzle_mismatches(cpp_swizzle, model), f"a wrong swizzle ({label}) went unnoticed"


def conflicted_ldmatrix_reads(offset_of, rows: int) -> list[tuple[int, int]]:
    """(first row, chunk) of every ldmatrix read (8 consecutive rows from a multiple of 8, one 16-byte chunk each)
    whose 8 chunks do not fall in 8 different 16-byte bank groups of a 128-byte span: a bank conflict."""
    chunk_elems = 16 // ELEM_BYTES
    bad = []
    for first in range(0, rows, 8):
        for chunk in range(2 * BOX_COLS // chunk_elems):
            groups = {offset_of(first + r, chunk * chunk_elems) * ELEM_BYTES // 16 % 8 for r in range(8)}
            if len(groups) != 8:
                bad.append((first, chunk))
    return bad


def test_tma_swizzle_lets_ldmatrix_read_without_bank_conflicts(cpp_swizzle):
    for rows, table in cpp_swizzle.items():
        assert not conflicted_ldmatrix_reads(lambda r, c: table[r, c], rows), f"bank conflicts in a [{rows}, 128] tile"
    # ... and the check sees conflicts where there are some: the same reads without the swizzle
    unswizzled = conflicted_ldmatrix_reads(lambda r, c: tma_swizzled_offset(64, r, c, row_bits=(7, 7)), 64)
    assert unswizzled, "the bank-conflict check found none in an unswizzled tile"
