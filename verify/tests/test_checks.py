"""CPU: the GPU checks' verdicts (verify/checks.py) fail when they must: NaN, unwritten output, too large errors."""
import math

import pytest

pytest.importorskip("torch")
from verify.checks import ATOL, LSE_ABS, O_REL_FROB, Errors  # noqa: E402

GOOD = dict(o_rel_frob=2e-3, o_max_abs=1e-2, o_max_abs_naive=1e-2, lse_max_abs=1e-5, nonfinite_o=0, nonfinite_lse=0)


def test_good_errors_pass():
    assert Errors(**GOOD).failures() == []


@pytest.mark.parametrize("field,value,match", [
    ("o_rel_frob", 2 * O_REL_FROB, "relative Frobenius"),
    ("o_rel_frob", math.nan, "relative Frobenius"),
    ("o_max_abs", 2 * 1e-2 + 2 * ATOL, "max abs"),
    ("o_max_abs", math.nan, "max abs"),
    ("lse_max_abs", 2 * LSE_ABS, "LSE"),
    ("lse_max_abs", math.inf, "LSE"),
    ("nonfinite_o", 1, "non-finite"),
    ("nonfinite_lse", 3, "non-finite"),
])
def test_bad_errors_fail(field, value, match):
    bad = Errors(**{**GOOD, field: value}).failures()
    assert bad and any(match in b for b in bad), bad
