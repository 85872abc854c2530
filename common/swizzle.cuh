// flashladder/common/swizzle.cuh -- XOR-swizzled shared-memory layouts.
#pragma once

// A shared-memory tile of [rows, ROW_ELEMS] bf16 with ROW_ELEMS = 128: each row is 256 bytes, sixteen
// 16-byte chunks. ldmatrix reads one 16-byte chunk from each of 8 consecutive rows at the same column.
// Unswizzled, those 8 chunks sit 256 bytes apart: 256 is a multiple of the 128 bytes that the 32 banks
// x 4 bytes span, so all 8 land in the same 4 banks -- an 8-way bank conflict, 8 wavefronts instead of 1.
//
// The fix: store chunk c of row r at chunk position c ^ (r % 8). The 8 rows an ldmatrix touches have
// 8 different r % 8, so their chunks land at 8 different positions within one 128-byte span: 32
// distinct banks, one wavefront. The XOR is its own inverse and stays inside the row, so writers and
// readers only have to agree on this one function. (Hopper's TMA/wgmma "128B swizzle" is the same idea
// for rows of at most 128 bytes -- it XORs address bits 4-6 with bits 7-9 -- so the TMA steps split a
// 256-byte row into two 64-element halves: swizzle_tma_128b below.)
//
// col must be a multiple of 8 elements (16 bytes) plus an offset inside the chunk (col % 8).
template <int ROW_ELEMS>
__device__ __forceinline__ int swizzle_128b(int row, int col) {
    static_assert(ROW_ELEMS % 64 == 0, "rows must span whole 128-byte groups of 8 chunks");
    const int chunk = col / 8;
    return row * ROW_ELEMS + ((chunk ^ (row % 8)) * 8) + col % 8;
}

// TMA's SWIZZLE_128B layout of a [ROWS, HEAD_DIM] bf16 tile (the layout the TMA steps load and wgmma reads).
// The bulk-tensor copy writes boxes whose rows are at most 128 bytes, and its 128-byte swizzle XORs address
// bits 4-6 (the 16-byte chunk inside a 128-byte row) with bits 7-9 (the row inside an 8-row, 1024-byte atom).
// A 256-byte head-dim row therefore arrives as two 64-column halves, each half a dense [ROWS, 64] tile:
//     half h = col / 64 at element offset h * ROWS * 64; inside it, chunk c of row r at chunk c ^ (r % 8).
// Inside a half this is swizzle_128b<64>; the tile base must be 1024-byte aligned for the XOR to line up
// with the hardware's (it reads the address bits, not the offset).
constexpr int TMA_HALF_COLS = 64;  // 64 bf16 = 128 bytes: the widest row the 128-byte swizzle handles
template <int ROWS>
__device__ __forceinline__ int swizzle_tma_128b(int row, int col) {
    return (col / TMA_HALF_COLS) * ROWS * TMA_HALF_COLS + swizzle_128b<TMA_HALF_COLS>(row, col % TMA_HALF_COLS);
}
