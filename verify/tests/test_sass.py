"""CPU: each step's machine code (SASS) holds the instructions the step is about, and none it claims to remove.

cuobjdump disassembles the built _kernel.so (the `built` fixture compiles every step); no GPU is needed. A claim
holds from the step that introduced it on, so a step added later is checked by the same table, by its number.
Each claim is shown to fail on a kernel without it (test_each_claim_fails_on_a_kernel_without_it): the step
before the one that introduced it, or a tiny kernel compiled here where no earlier step can serve.

cuobjdump is looked for on PATH, under CUDA_HOME, beside nvcc, and in the nvidia-cuda-cuobjdump wheel
(`pip install nvidia-cuda-cuobjdump`; nox -s tests installs it). Without one these tests fail: a claim that
cannot be checked is not a claim that holds.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from verify import steps as steps_mod
from verify.tests.conftest import selected_steps

build_step = steps_mod.build_step


@dataclass(frozen=True)
class Claim:
    """What a step's SASS shows, from step `first` on (up to step `last`, where a later step replaces it)."""
    name: str                 # the test id's part: no step name in it (verify runs `pytest -k stepNN` per step)
    first: int
    last: int | None
    present: dict[str, str] = field(default_factory=dict)  # what -> regex that some instruction must match
    absent: dict[str, str] = field(default_factory=dict)   # what -> regex that no instruction may match
    counterexample: str | None = None  # a kernel without the claim, for a claim no earlier step can refute
    # (what, start, end, inner, at_least): in some stretch of code from an instruction matching `start` to the
    # next one matching `end`, at least `at_least` instructions match `inner` (where the compiler put things).
    between: tuple | None = None

    def parts(self) -> int:
        return len(self.present) + len(self.absent) + (self.between is not None)

    def covers(self, step_number: int) -> bool:
        return self.first <= step_number and (self.last is None or step_number <= self.last)

    def problems(self, sass: list[Instruction]) -> list[str]:
        """One line per part of the claim that this SASS breaks; empty when the claim holds."""
        out = []
        for what, pattern in self.present.items():
            if not any(re.match(pattern, i.text) for i in sass):
                out.append(f"no {what} in its {len(sass)} instructions")
        for what, pattern in self.absent.items():
            hits = [i for i in sass if re.match(pattern, i.text)]
            if hits:
                out.append(f"{what} is still there: {len(hits)} instructions, e.g. {hits[0]}")
        if self.between:
            what, start, end, inner, at_least = self.between
            most = max(stretch_counts(sass, start, end, inner), default=None)
            if most is None or most < at_least:
                out.append(f"not {at_least} {what}: " + ("no such stretch" if most is None else f"at most {most}"))
        return out


def stretch_counts(sass, start: str, end: str, inner: str) -> list[int]:
    """For each instruction matching `start`: how many match `inner` before the next one matching `end` (in the
    same function, in address order; a stretch with no end is not counted, and a second start before the end
    begins the stretch anew)."""
    counts, open_count, function = [], None, None
    for i in sass:
        if i.function != function:
            open_count, function = None, i.function
        if open_count is not None and re.match(end, i.text):
            counts.append(open_count)
            open_count = None
        elif re.match(start, i.text):
            open_count = 0
        elif open_count is not None and re.match(inner, i.text):
            open_count += 1
    return counts


# A kernel that has to keep an array in local memory: stored and loaded at indices known only at run time.
LOCAL_MEMORY_CU = """
__global__ void uses_local_memory(float* out, int i, int k) {
    float a[256];
    for (int j = 0; j < 256; ++j) a[j] = out[j];
    a[k & 255] += 1.f;
    out[0] = a[i & 255];
}
"""

# The patterns match an instruction's text: `MNEMONIC.MODIFIERS operands` (predicate and address dropped).
CLAIMS = [
    Claim("mma_sync", 2, 8, present={"HMMA (mma.sync on the tensor cores)": r"HMMA\."}),
    Claim("ldmatrix_x4", 6, 8,
          present={"LDSM.16.MT88.4 (ldmatrix.x4.trans: V's B fragments, four 8x8 matrices at once)": r"LDSM\.16\.MT88\.4\s"},
          absent={"an ldmatrix of one or two matrices (LDSM without .4)": r"LDSM\S*(?<!\.4)\s"}),
    Claim("tma", 8, None, present={"UTMALDG (cp.async.bulk.tensor: TMA loads)": r"UTMALDG\b",
                                   "SYNCS.PHASECHK (mbarrier.try_wait.parity: waiting for a copy)": r"SYNCS\.PHASECHK\b"},
          absent={"LDGSTS (cp.async, per-thread copies)": r"LDGSTS\b"}),
    Claim("wgmma", 9, None,
          present={"HGMMA with A from shared memory (S = Q K^T, the SS form)": r"HGMMA\S*\s+R\d+,\s*gdesc",
                   "HGMMA with A from registers (O += P V, the RS form)": r"HGMMA\S*\s+R\d+,\s*R\d+,\s*gdesc"},
          absent={"HMMA (mma.sync)": r"HMMA\.", "LDSM (ldmatrix: wgmma reads shared memory itself)": r"LDSM\."}),
    Claim("setmaxnreg", 10, None,
          present={"USETMAXREG.DEALLOC (setmaxnreg.dec: the producer gives registers up)": r"USETMAXREG\.DEALLOC\b",
                   "USETMAXREG.TRY_ALLOC (setmaxnreg.inc: the consumers take them)": r"USETMAXREG\.TRY_ALLOC\b"}),
    Claim("named_barriers", 11, None,
          present={"BAR.ARV (bar.arrive: a consumer hands the tensor cores to the other, ping-pong)": r"BAR\.ARV\b"}),
    Claim("conditional_rescale", 12, None,
          present={"VOTE.ANY on a predicate (__any_sync: did any row of the warp move its max? if none, O is not rescaled)":
                   r"VOTE\.ANY\s+P\d"}),
    Claim("intra_warpgroup_overlap", 13, None,
          present={"WARPGROUP.DEPBAR.LE gsb0, 0x1 (wgmma.wait_group 1: the softmax starts with P V in flight)":
                   r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b"}),
    # 64 = a thread's exponentials of one tile (2 rows x 32 keys), all on MUFU.
    Claim("softmax_under_pv", 13, None,
          between=("MUFU.EX2 (a thread's 64 exponentials of one tile) between wgmma.wait_group 1 and the next "
                   "wait_group 0: they run while P V is in flight, not after it (without the fence, ptxas puts none there)",
                   r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b", r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", r"MUFU\.EX2\b", 64)),
    Claim("tma_store", 14, None, present={"UTMASTG (cp.async.bulk.tensor shared -> global: the epilogue)": r"UTMASTG\b"}),
    Claim("no_local_memory", 1, None, absent={"LDL (a load from local memory)": r"LDL\b",
                                              "STL (a store to local memory)": r"STL\b"},
          counterexample=LOCAL_MEMORY_CU),
]


@dataclass(frozen=True)
class Instruction:
    function: str
    address: str
    text: str  # MNEMONIC.MODIFIERS operands

    def __str__(self):
        return f"/*{self.address}*/ {self.text} (in {self.function})"


FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# `/*0a30*/   @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;   /* 0x... */`
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][^;]*?)\s*;")


def parse_sass(text: str) -> list[Instruction]:
    function, out = "?", []
    for line in text.splitlines():
        if m := FUNCTION.match(line):
            function = m.group(1)
        elif m := INSTRUCTION.match(line):
            out.append(Instruction(function, m.group(1), re.sub(r"\s+", " ", m.group(2))))
    return out


def find_cuobjdump() -> str | None:
    """On PATH, under CUDA_HOME, beside nvcc, or in the nvidia-cuda-cuobjdump wheel (nvidia/<cuXX or name>/bin)."""
    candidates = [shutil.which("cuobjdump")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    try:
        candidates.append(str(Path(build_step.find_nvcc()).resolve().parent / "cuobjdump"))
    except RuntimeError:
        pass
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(str(p) for p in Path(root).glob("*/bin/cuobjdump"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def cuobjdump() -> str:
    tool = find_cuobjdump()
    if tool is None:
        pytest.fail("cuobjdump not found (on PATH, under CUDA_HOME, beside nvcc, or from the nvidia-cuda-cuobjdump "
                    "wheel): `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, or install the CUDA toolkit's cuobjdump",
                    pytrace=False)
    return tool


def run_cuobjdump(tool: str, binary: str) -> subprocess.CompletedProcess:
    """`cuobjdump -sass BINARY`. cuobjdump calls nvdisasm, which it looks for on PATH only: the directory of
    the cuobjdump found goes first on PATH (the nvidia-cuda-nvdisasm wheel puts nvdisasm beside it)."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")])}
    return subprocess.run([tool, "-sass", binary], capture_output=True, text=True, env=env)


@functools.lru_cache(maxsize=None)
def _sass(tool: str, binary: str, mtime_ns: int) -> tuple[Instruction, ...]:
    proc = run_cuobjdump(tool, binary)
    assert proc.returncode == 0, f"{tool} -sass {binary} failed:\n{proc.stdout}{proc.stderr}"
    sass = parse_sass(proc.stdout)
    # An empty parse would make every "absent" part of a claim pass: refuse it.
    assert sass, f"no SASS instruction read from `{tool} -sass {binary}`; its output begins:\n{proc.stdout[:2000]}"
    return tuple(sass)


def sass_of(tool: str, binary: Path) -> list[Instruction]:
    return list(_sass(tool, str(binary), binary.stat().st_mtime_ns))


def kernel_so(step: str) -> Path:
    return steps_mod.DEV / "flashladder" / step / "_kernel.so"


def step_number(step: str) -> int:
    return int(step[len("step"):])


def pytest_generate_tests(metafunc):
    if "step_claim" in metafunc.fixturenames:
        pairs = [(s, c) for s in selected_steps() for c in CLAIMS if c.covers(step_number(s))]
        metafunc.parametrize("step_claim", pairs, ids=[f"{s}-{c.name}" for s, c in pairs])


def test_sass_shows_the_claim(step_claim, built, cuobjdump):
    step, claim = step_claim
    problems = claim.problems(sass_of(cuobjdump, kernel_so(step)))
    assert not problems, f"{step} ({claim.name}, claimed from step{claim.first:02d} on): " + "; ".join(problems)


def test_sass_parser_reads_predicates_and_modifiers():
    text = """
        Function : kernel_a
        /*0040*/               @P1 BRA 0x1b0 ;                                   /* 0x0000000000581947 */
        /*0dd0*/              @!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR7+0x28028], RZ ;  /* 0x028028ffffff89a7 */
        /*07a0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;  /* 0x01e000000c1879f0 */
                                                                                     /* 0x000fe20000000800 */
        Function : kernel_b
        /*25e0*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR8].tnspB, R88 ;  /* 0x41e0000818587df0 */
    """
    got = [(i.function, i.address, i.text) for i in parse_sass(text)]
    assert got == [("kernel_a", "0040", "BRA 0x1b0"), ("kernel_a", "0dd0", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR7+0x28028], RZ"),
                   ("kernel_a", "07a0", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT"),
                   ("kernel_b", "25e0", "HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR8].tnspB, R88")]
    wgmma = next(c for c in CLAIMS if c.name == "wgmma")
    ss, rs = wgmma.present.values()
    assert [bool(re.match(ss, t)) for *_, t in got[2:]] == [True, False]
    assert [bool(re.match(rs, t)) for *_, t in got[2:]] == [False, True]


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.name for c in CLAIMS])
def test_each_claim_fails_on_a_kernel_without_it(claim, cuobjdump, tmp_path):
    """Every part of every claim fails somewhere real: on the step before the one that introduced the claim
    (it lacks each instruction the claim requires and still has each one the claim says is gone), or, for a
    claim of every step, on a tiny kernel compiled here. A check that cannot fail checks nothing."""
    if claim.counterexample:
        src, binary = tmp_path / "counterexample.cu", tmp_path / "counterexample.cubin"
        src.write_text(claim.counterexample)
        proc = subprocess.run([build_step.find_nvcc(), "-cubin", *build_step.ARCH_FLAGS, "-O3", str(src), "-o", str(binary)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        what = "the counterexample kernel"
    else:
        earlier = [s for s in steps_mod.all_steps() if step_number(s) < claim.first]
        assert earlier, f"claim {claim.name!r} starts at step{claim.first:02d} and no step comes before it: give it a counterexample"
        previous = earlier[-1]
        steps_mod.build([previous], log=lambda *_: None)  # the `built` fixture may have built only a selection
        binary, what = kernel_so(previous), previous
    problems = claim.problems(sass_of(cuobjdump, binary))
    assert len(problems) == claim.parts(), (
        f"claim {claim.name!r}: only {len(problems)} of its {claim.parts()} parts fail on {what}: {problems}")


def test_stretch_counts_counts_between_each_start_and_its_end():
    text = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R1, R1", "MUFU.EX2 R2, R2", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "MUFU.EX2 R3, R3", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R4, R4"]  # the last stretch never ends: not counted
    sass = [Instruction("k", f"{i:04x}", s) for i, s in enumerate(text)]
    claim = next(c for c in CLAIMS if c.name == "softmax_under_pv")
    _, start, end, inner, _ = claim.between
    assert stretch_counts(sass, start, end, inner) == [2, 0]
    assert claim.problems(sass) == [f"not 64 {claim.between[0]}: at most 2"]
