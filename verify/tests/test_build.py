"""CPU: every step compiles with nvcc for sm_90a, spills nothing, and exports the C ABI the binding expects."""
import ctypes

from verify import steps as steps_mod


def test_compiles_without_spills(step, built):
    report = built[step]
    assert report, f"{step}: no kernel found in the ptxas report"
    for kernel, res in report.items():
        assert "spill_stores" in res and "spill_loads" in res, f"{step} {kernel}: ptxas reported no spill counts: {res}"
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, f"{step} {kernel} spills: {res}"
        assert "registers" in res, f"{step} {kernel}: ptxas reported no register count: {res}"


def test_exports_the_abi(step, built):
    lib = ctypes.CDLL(str(steps_mod.DEV / "flashladder" / step / "_kernel.so"))
    import binding  # common/binding.py (verify.steps puts common/ on sys.path)
    assert lib.flashladder_abi_version() == binding.ABI_VERSION
    assert lib.flashladder_params_size() == ctypes.sizeof(binding.FwdParams)
    multiples = (lib.flashladder_seqlen_multiple_q(), lib.flashladder_seqlen_multiple_k())
    if multiples == (1, 1):  # any seqlen: then the step says what its tiles are
        multiples = (lib.flashladder_tile_q(), lib.flashladder_tile_k())
    for mult in multiples:
        assert mult > 0 and mult % 64 == 0, f"{step}: odd seqlen multiple or tile {mult}"


def test_steps_are_found_by_glob():
    names = steps_mod.all_steps()
    assert names and names == sorted(names) and names[0] == "step01"
    assert all(len(n) == 6 and n[4:].isdigit() for n in names)


def test_driver_entry_points_need_no_libcuda(tmp_path):
    """common/driver_api.cuh (for the TMA steps) builds without -lcuda and answers, GPU or not."""
    import subprocess

    from verify.tests.conftest import has_cuda_gpu
    src = tmp_path / "probe.cu"
    src.write_text('#include "driver_api.cuh"\n'
                   'extern "C" int probe() { cudaError_t e; return driver_cuTensorMapEncodeTiled(&e) ? 0 : int(e); }\n')
    so = tmp_path / "probe.so"
    nvcc = steps_mod.build_step.find_nvcc()
    subprocess.run([nvcc, "-std=c++17", *steps_mod.build_step.ARCH_FLAGS, f"-I{steps_mod.build_step.COMMON}", "-shared",
                    "-Xcompiler", "-fPIC", str(src), "-o", str(so)], check=True, capture_output=True)
    deps = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert "libcuda.so" not in deps, deps
    code = ctypes.CDLL(str(so)).probe()
    if has_cuda_gpu():
        assert code == 0, f"cuTensorMapEncodeTiled not found (cudaError {code})"
    else:
        assert code != 0  # no driver here: an error code, not a crash
