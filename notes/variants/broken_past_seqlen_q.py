"""Two copies of step14 that write past seqlen_q, for showing that test_writes_nothing_past_seqlen_q fails on them.

    python notes/variants/broken_past_seqlen_q.py steps/step14/kernel.cu .scratch/broken
    # .scratch/broken/{lse,o}/kernel.cu; on the GPU machine, for each: copy it over steps/step14/kernel.cu and
    python -m pytest -q -p no:cacheprovider verify/tests/test_steps_gpu.py -k "writes_nothing and step14"

  lse: the LSE store loses its `q_row < p.seqlen_q` guard (the rows of the last tile's padding are stored).
  o:   O's tensor map is told seqlen_q rounded up to a whole 128-row tile, so the TMA store no longer clips.
"""
import sys
from pathlib import Path

src, dst = Path(sys.argv[1]).read_text(), Path(sys.argv[2])


def rep(text, old, new):
    assert text.count(old) == 1, (old, text.count(old))
    return text.replace(old, new)


variants = {
    "lse": rep(src, "if (quad_col == 0 && q_row < p.seqlen_q)", "if (quad_col == 0)"),
    "o": rep(src, "encode_tile_map(&O_map, p.o, p.o_stride, p.seqlen_q,",
             "encode_tile_map(&O_map, p.o, p.o_stride, ceil_div(p.seqlen_q, BLOCK_M) * BLOCK_M,"),
}
for name, text in variants.items():
    (dst / name).mkdir(parents=True, exist_ok=True)
    (dst / name / "kernel.cu").write_text(text)
    print(f"wrote {dst / name / 'kernel.cu'}")
