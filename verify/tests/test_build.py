"""CPU: every step compiles with nvcc for each architecture of its targets (common/build_step.py's TARGETS: steps
01-07 for sm_80, sm_86, sm_89, sm_90a and sm_120 with compute_80 PTX, steps 08-14 for sm_90a), spills nothing on
any of them, and exports the C ABI the binding expects; a kernel.cu's FLASHLADDER_TARGETS line is read, and a build
that missed it fails."""
import ctypes
import re
import subprocess

import pytest

from verify import steps as steps_mod

build_step = steps_mod.build_step


def test_compiles_without_spills(step, built):
    """ptxas -v reports every architecture the step has SASS for, in a block of its own, with no spill in any."""
    report, targets = built[step], steps_mod.targets(step)
    assert sorted(report) == sorted(targets.sass()), \
        f"{step}: ptxas reported {sorted(report)}, its targets ({targets.name}) have SASS for {targets.sass()}"
    if not report:
        pytest.skip(f"{step}: this build is its PTX alone (FLASHLADDER_PTX_JIT): ptxas runs in the driver")
    for arch, kernels in report.items():
        assert kernels, f"{step}: no kernel found in the ptxas report for {arch}"
        for kernel, res in kernels.items():
            assert "spill_stores" in res and "spill_loads" in res, f"{step} {kernel} ({arch}): ptxas reported no spill counts: {res}"
            assert res["spill_stores"] == 0 and res["spill_loads"] == 0, f"{step} {kernel} spills on {arch}: {res}"
            assert "registers" in res, f"{step} {kernel} ({arch}): ptxas reported no register count: {res}"


def test_the_ptxas_report_has_a_block_per_architecture(step, built):
    """_ptxas.txt (shipped in the wheel) holds each architecture's lines under its own `== sm_XX ==` heading."""
    text = (steps_mod.DEV / "flashladder" / step / "_ptxas.txt").read_text()
    headings = re.findall(r"^== (\S+) ==$", text, re.M)
    assert headings == steps_mod.targets(step).sass(), f"{step}: headings {headings}"
    for block in re.split(r"^== \S+ ==$", text, flags=re.M)[1:]:
        assert len(set(re.findall(r"for '(\w+)'", block))) == 1, f"{step}: a block mixes architectures:\n{block}"


# ptxas's note when it puts a wait after every wgmma of a kernel (C7514 / C7515 "Potential Performance Loss: wgmma.mma_async
# instructions are serialized due to ..."): the kernel still computes the right thing, only slowly, and says so nowhere
# else. Step32 met it by leaving a wgmma group running from one loop iteration into the next.
WGMMA_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized")


def test_no_kernel_has_its_wgmma_serialized(step, built):
    """No kernel of the step is one whose wgmma ptxas serialized (its _ptxas.txt holds no such note)."""
    text = (steps_mod.DEV / "flashladder" / step / "_ptxas.txt").read_text()
    notes = [line.strip() for line in text.splitlines() if WGMMA_SERIALIZED.search(line)]
    assert not notes, f"{step}: ptxas serialized the wgmma of a kernel:\n" + "\n".join(notes)


# A kernel that reads its accumulator while the wgmma writing it may still run (the read before the wait), and the same
# kernel with the read after the wait.
WGMMA_PROBE = """#include "flashladder.cuh"
#include "wgmma.cuh"
__global__ void probe(float* out, uint64_t a, uint64_t b, int n) {{
    float d[32] = {{}};
    for (int i = 0; i < n; ++i) {{
        wgmma_fence();
        wgmma_m64n64k16_ss<0, 0>(d, a, b, 1);
        wgmma_commit_group();
        {early}
        wgmma_wait_group<0>();
        wgmma_fence_operands(d);
        {late}
    }}
}}
"""


def test_the_serialization_note_is_seen(tmp_path):
    """The check above bites: ptxas writes the note for a kernel that reads an accumulator before its wgmma's wait, the
    pattern finds it in nvcc's output, and the same kernel with the read after the wait has none."""
    flags = [*build_step.target_flags(build_step.TARGETS["sm90a_only"]), "-O3", "-Xptxas", "-v"]
    read = "out[threadIdx.x + i * 128] = d[0];"
    early = compile_probe(tmp_path, WGMMA_PROBE.format(early=read, late=""), flags)
    assert early.returncode == 0, early.stdout + early.stderr
    assert WGMMA_SERIALIZED.search(early.stdout + early.stderr), early.stdout + early.stderr
    late = compile_probe(tmp_path, WGMMA_PROBE.format(early="", late=read), flags)
    assert late.returncode == 0, late.stdout + late.stderr
    assert not WGMMA_SERIALIZED.search(late.stdout + late.stderr), late.stdout + late.stderr


def test_exports_the_abi(step, built):
    lib = ctypes.CDLL(str(steps_mod.DEV / "flashladder" / step / "_kernel.so"))
    import binding  # common/binding/ (verify.steps puts common/ on sys.path)
    assert lib.flashladder_abi_version() == binding.ABI_VERSION
    assert lib.flashladder_params_size() == ctypes.sizeof(binding.FwdParams)
    lib.flashladder_archs.restype = ctypes.c_char_p
    assert lib.flashladder_archs().decode().split(",") == steps_mod.targets(step).archs()
    if steps_mod.targets(step).ptx():  # a step for GPUs beyond Hopper says what shared memory a block takes
        assert 0 < lib.flashladder_smem_bytes() <= 99 * 1024, f"{step}: {lib.flashladder_smem_bytes()} bytes"
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


# ---- the targets: a kernel.cu's FLASHLADDER_TARGETS line, read by the build and checked by the compile ----

def kernel_dir(tmp_path, text: str):
    (tmp_path / "kernel.cu").write_text(text)
    return tmp_path


def test_the_targets_line_is_read(tmp_path):
    assert build_step.targets_of(kernel_dir(tmp_path, "// nothing said\n")).name == build_step.DEFAULT_TARGETS
    assert build_step.targets_of(kernel_dir(tmp_path, "FLASHLADDER_TARGETS(sm80_and_later);\n")).name == "sm80_and_later"
    assert build_step.targets_of(kernel_dir(tmp_path, "  FLASHLADDER_TARGETS( sm80_and_later ) ;\n")).name == "sm80_and_later"
    with pytest.raises(RuntimeError, match="names no targets; .*TARGETS has sm90a_only, sm80_and_later"):
        build_step.targets_of(kernel_dir(tmp_path, "FLASHLADDER_TARGETS(sm75_and_later);\n"))
    with pytest.raises(RuntimeError, match="appears 2 times"):
        build_step.targets_of(kernel_dir(tmp_path, "FLASHLADDER_TARGETS(sm80_and_later);\nFLASHLADDER_TARGETS(sm90a_only);\n"))


def test_every_portable_step_says_so_and_the_rest_are_sm90a(built):
    """Steps 01-07 run on every GPU since Ampere; steps 08 on use wgmma, TMA or setmaxnreg: sm_90a alone."""
    names = {s: build_step.targets_of(steps_mod.step_dir(s)).name for s in steps_mod.all_steps()}
    assert {s for s, n in names.items() if n == "sm80_and_later"} == {f"step{i:02d}" for i in range(1, 8)}, names
    assert {s for s, n in names.items() if n == "sm90a_only"} == {s for s in names if int(s[4:]) >= 8}, names


def compile_probe(tmp_path, source: str, flags: list[str]) -> subprocess.CompletedProcess:
    src = tmp_path / "probe.cu"
    src.write_text(source)
    return subprocess.run([build_step.find_nvcc(), "-std=c++17", *flags, f"-I{build_step.COMMON}", "-c", str(src),
                           "-o", str(tmp_path / "probe.o")], capture_output=True, text=True)


PROBE = '#include "flashladder.cuh"\n{line}\nFLASHLADDER_EXPORT int probe() {{ return 0; }}\n'


def test_a_targets_line_the_build_missed_fails_the_compile(tmp_path):
    """A declaration the build's reading does not see (here: not at the start of its line) meets the default's
    flags, and its static_assert stops the compile, saying why; read, it compiles."""
    missed = PROBE.format(line="static_assert(true); FLASHLADDER_TARGETS(sm80_and_later);")
    assert build_step.targets_of(kernel_dir(tmp_path, missed)).name == "sm90a_only"  # the build does not see it
    proc = compile_probe(tmp_path, missed, build_step.target_flags(build_step.targets_of(tmp_path)))
    assert proc.returncode != 0 and "kernel.cu names the targets sm80_and_later, but the build compiled it for sm90a_only" \
        in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    read = PROBE.format(line="FLASHLADDER_TARGETS(sm80_and_later);")
    proc = compile_probe(tmp_path, read, build_step.target_flags(build_step.targets_of(kernel_dir(tmp_path, read))))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_kernel_compiled_without_the_build_says_so(tmp_path):
    proc = compile_probe(tmp_path, PROBE.format(line=""), build_step.ARCH_FLAGS)
    assert proc.returncode != 0 and "build the steps with common/build_step.py" in proc.stdout + proc.stderr


def test_ptxas_report_groups_lines_by_architecture():
    """ptxas runs once per architecture, side by side; its lines are grouped under each, a spill warning (printed
    before its run's info lines) with its own run, and the parser reads each architecture's counts apart."""
    kernel = "_ZN41_GLOBAL__N__5af2276c_9_kernel_cu_6d475b9220attention_fwd_kernelE9FwdParams"
    def run(arch, regs, spill):
        return ([f"ptxas warning : Registers are spilled to local memory in function '{kernel}', {spill} bytes spill stores, "
                 f"{spill} bytes spill loads"] if spill else []) + [
            "ptxas info    : 0 bytes gmem", f"ptxas info    : Compiling entry function '{kernel}' for '{arch}'",
            f"ptxas info    : Function properties for {kernel}",
            f"    {spill} bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads",
            f"ptxas info    : Used {regs} registers, used 1 barriers", "ptxas info    : Compile time = 1.0 ms"]
    output = "\n".join(["kernel.cu(1): warning: a host compiler's", *run("sm_90a", 255, 0), *run("sm_120", 255, 16),
                        *run("sm_80", 200, 0)])
    targets = build_step.Targets("t", (("compute_80", ("sm_80", "sm_120", "compute_80")), ("compute_90a", ("sm_90a",))))
    report = build_step.ptxas_report(output, targets)
    lines = report.splitlines()
    assert lines[0] == "# ptxas -v for sm_80, sm_90a, sm_120; embedded PTX, compiled by the driver at load: compute_80"
    assert lines[1] == "kernel.cu(1): warning: a host compiler's"
    assert [ln for ln in lines if ln.startswith("==")] == ["== sm_80 ==", "== sm_90a ==", "== sm_120 =="]
    sm120 = report.split("== sm_120 ==")[1]
    assert sm120.lstrip().startswith("ptxas warning : Registers are spilled"), report
    parsed = build_step.parse_ptxas(report)
    assert {a: (r["registers"], r["spill_stores"]) for a, ks in parsed.items() for r in ks.values()} == \
        {"sm_80": (200, 0), "sm_90a": (255, 0), "sm_120": (255, 16)}
    assert parsed == build_step.parse_ptxas(output), "the grouped report and nvcc's output read the same"


def test_the_build_runs_no_device_link(tmp_path):
    """nvcc's plan for a step with several architectures (nvcc --dryrun, the build's own flags) has no nvlink run: a
    device link of a one-file, non-rdc build links nothing, and under --threads each architecture's nvlink writes the
    same temporary registration file (a race: "nvlink fatal: Could not read file ..._dlink.reg.c")."""
    portable = build_step.TARGETS["sm80_and_later"]
    cmd = [build_step.find_nvcc(), "--dryrun", *build_step.NVCC_FLAGS, *build_step.target_flags(portable),
           f"-I{build_step.COMMON}", str(build_step.ROOT / "steps" / "step01" / "kernel.cu"), "-o", str(tmp_path / "k.so")]
    plan = subprocess.run(cmd, capture_output=True, text=True, check=True)
    steps = [line for line in (plan.stdout + plan.stderr).splitlines() if line.startswith("#$ ")]
    assert any(line.split()[1] == "ptxas" for line in steps), "not nvcc's plan: no ptxas in it"
    linked = [line[:160] for line in steps if line.split()[1] == "nvlink"]
    assert not linked, "nvcc runs a device link for each architecture:\n" + "\n".join(linked)
