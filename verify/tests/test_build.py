"""CPU: every step compiles with nvcc for sm_90a, spills nothing, and exports the C ABI the binding expects."""
import ctypes

from verify import steps as steps_mod


def test_compiles_without_spills(step, built):
    report = built[step]
    assert report, f"{step}: no kernel found in the ptxas report"
    for kernel, res in report.items():
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, f"{step} {kernel} spills: {res}"
        assert "registers" in res, f"{step} {kernel}: ptxas reported no register count: {res}"


def test_exports_the_abi(step, built):
    lib = ctypes.CDLL(str(steps_mod.DEV / "flashladder" / step / "_kernel.so"))
    assert lib.flashladder_abi_version() == 1
    mult = lib.flashladder_seqlen_multiple()
    assert mult > 0 and mult % 64 == 0, f"{step}: odd seqlen multiple {mult}"


def test_steps_are_found_by_glob():
    names = steps_mod.all_steps()
    assert names and names == sorted(names) and names[0] == "step01"
    assert all(len(n) == 6 and n[4:].isdigit() for n in names)
