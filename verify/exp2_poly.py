"""2^x on the FMA pipe, as steps 13-14 compute it (common/ptx.cuh: exp2_poly3), mirrored in numpy float32.

x = j + f with j = round(x) and f in [-0.5, 0.5]; 2^f by a degree-3 polynomial fitted for relative error on
that interval; 2^j added to the exponent bits. The tests (verify/tests/test_exp2_poly.py) bound its error
alone and inside the tiled online softmax (verify/model.py's exp2 hook), and check that these coefficients
are the ones in common/ptx.cuh.
"""
import numpy as np

COEFFS = np.array([0.99992806, 0.69326097, 0.24261113, 0.055171665], dtype=np.float32)  # c0 + c1 f + c2 f^2 + c3 f^3
ROUND = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
LOWEST = np.float32(-126.0)     # x is clamped here: 2^j stays a normal exponent


def exp2_poly3(x):
    """float32 2^x for x <= 127, the kernels' bit-for-bit recipe (up to FMA vs. multiply-add rounding)."""
    x = np.maximum(np.asarray(x, dtype=np.float32), LOWEST)
    t = (x + ROUND).astype(np.float32)
    f = (x - (t - ROUND)).astype(np.float32)
    c0, c1, c2, c3 = COEFFS
    p = (((c3 * f + c2) * f + c1) * f + c0).astype(np.float32)
    with np.errstate(over="ignore"):
        bits = p.view(np.int32) + (t.view(np.int32) << np.int32(23))  # int32 arithmetic wraps, as in the kernel
    return bits.view(np.float32)
