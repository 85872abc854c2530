"""CPU: each step's machine code (SASS) holds the instructions the step is about, and none it claims to remove,
on every architecture the step's library holds SASS for; the PTX it embeds for the others is there, is the PTX that
the PTX-JIT check (python -m verify --ptx-jit) runs, and compiles without spills where a driver compiles it.

cuobjdump disassembles the built _kernel.so (the `built` fixture compiles every step); no GPU is needed. It prints
one section per architecture; each claim is checked on each of the step's (steps 01-07: sm_80, sm_86, sm_89, sm_90a,
sm_120; steps 08-14: sm_90a, common/build_step.py's TARGETS). A claim
holds from the step that introduced it on, so a step added later is checked by the same table, by its number.
Each claim is shown to fail on a kernel without it (test_each_claim_fails_on_a_kernel_without_it): the step
before the one that introduced it, or a tiny kernel compiled here where no earlier step can serve.

cuobjdump is looked for on PATH, under CUDA_HOME, beside nvcc, and in the nvidia-cuda-cuobjdump wheel
(`pip install nvidia-cuda-cuobjdump`; nox -s tests installs it). Without one these tests fail: a claim that
cannot be checked is not a claim that holds.
"""
from __future__ import annotations

import collections
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
    # (what, start, end, inner, at_most): in every stretch from an instruction matching `start` to the next one
    # matching `end` (at least one), no chain of `inner` instructions, each reading the one before through a
    # register, is longer than `at_most` (how long the code after waits for them).
    chain: tuple | None = None
    # The kernels it is about: "forward" (every kernel but the backward's, bwd_*), "backward" (bwd_*) or "all".
    part: str = "forward"

    def kernels(self, sass: list[Instruction]) -> list[Instruction]:
        """The instructions of the kernels the claim is about."""
        if self.part == "all":
            return sass
        return [i for i in sass if ("bwd_" in i.function) == (self.part == "backward")]

    def parts(self) -> int:
        return len(self.present) + len(self.absent) + (self.between is not None) + (self.chain is not None)

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
        if self.chain:
            what, start, end, inner, at_most = self.chain
            if at_most == "row_max_chain_limit":  # per function, from the width of its K/V tile
                found = False
                for function, code in functions_of(sass).items():
                    chains = longest_chains(code, start, end, inner)
                    found |= bool(chains)
                    if chains and max(chains) > row_max_chain_limit(code):
                        out.append(f"not {what}: a chain of {max(chains)} in {function} (at most {row_max_chain_limit(code)})")
                if not found:
                    out.append(f"not {what}: no such stretch")
            else:
                longest = max(longest_chains(sass, start, end, inner), default=None)
                if longest is None or longest > at_most:
                    out.append(f"not {what}: " + ("no such stretch" if longest is None else f"a chain of {longest}"))
        return out


def functions_of(sass: list[Instruction]) -> dict[str, list[Instruction]]:
    out: dict[str, list[Instruction]] = {}
    for i in sass:
        out.setdefault(i.function, []).append(i)
    return out


def row_max_chain_limit(code: list[Instruction]) -> int:
    """The longest FMNMX chain a row max in four chains may have in a function: ceil(blocks / 4) per chain, two to join
    the four, two after the quad's shuffles, where blocks = the widest wgmma's N / 8 (the K/V tile's keys; 128 without
    a wgmma): 8 at 128 keys, 10 at 176."""
    widths = [int(m.group(1)) for i in code if (m := re.match(r"HGMMA\.64x(\d+)x16", i.text))]
    blocks = max(widths, default=128) // 8
    return -(-blocks // 4) + 4


def stretches(sass, start: str, end: str) -> list[list[Instruction]]:
    """The instructions between each one matching `start` and the next one matching `end` (in the same function,
    in address order; a stretch with no end is left out, and a second start before the end begins it anew)."""
    out, current, function = [], None, None
    for i in sass:
        if i.function != function:
            current, function = None, i.function
        if current is not None and re.match(end, i.text):
            out.append(current)
            current = None
        elif re.match(start, i.text):
            current = []
        elif current is not None:
            current.append(i)
    return out


def stretch_counts(sass, start: str, end: str, inner: str) -> list[int]:
    """For each stretch (stretches): how many of its instructions match `inner`."""
    return [sum(bool(re.match(inner, i.text)) for i in s) for s in stretches(sass, start, end)]


REGISTER = re.compile(r"\bR(\d+)\b")  # R0-R255; not RZ, not the uniform UR registers


def longest_chains(sass, start: str, end: str, inner: str) -> list[int]:
    """For each stretch (stretches): the longest chain of `inner` instructions in it, each reading a register the
    one before wrote (the first operand is the one written). Any other instruction that writes a register ends
    the chains through it."""
    out = []
    for s in stretches(sass, start, end):
        depth = {}
        for i in s:
            registers = REGISTER.findall(i.text.split(None, 1)[1] if " " in i.text else "")
            if not registers:
                continue
            written, read = registers[0], registers[1:]
            if re.match(inner, i.text):
                depth[written] = 1 + max((depth.get(r, 0) for r in read), default=0)
            else:
                depth.pop(written, None)
        out.append(max(depth.values(), default=0))
    return out


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
    Claim("ldmatrix", 2, 8, present={"LDSM (ldmatrix: the mma fragments, from shared memory)": r"LDSM\."}),
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
    # 8 = four chains of four FMNMX per row, two more to join them, two after the quad's shuffles. One chain over a
    # row's 16 key blocks is 19. A kernel with wider K/V tiles (176 keys: 22 blocks of 8) is allowed the longer chains
    # of the same four: six FMNMX each, 10 in all (row_max_chain_limit).
    Claim("short_row_max", 13, None,
          chain=("a row max in short chains: between each wgmma wait and the next MUFU.EX2, no chain of dependent FMNMX "
                 "longer than 8 at 128 keys per tile (the exponentials wait for it)",
                 r"WARPGROUP\.DEPBAR\.LE\s+gsb0", r"MUFU\.EX2\b", r"FMNMX\b", "row_max_chain_limit")),
    Claim("tma_store", 14, None, present={"UTMASTG (cp.async.bulk.tensor shared -> global: the epilogue)": r"UTMASTG\b"}),
    Claim("cta_pairs", 16, None,
          present={"UTMALDG.4D.MULTICAST (one TMA copy into both CTAs of a pair)": r"UTMALDG\.\S*MULTICAST\b",
                   "SYNCS.ARRIVE...RED (mbarrier.arrive.shared::cluster: a slot released in the peer CTA too)":
                   r"SYNCS\.ARRIVE\.\S*RED\b",
                   "UCGABAR (barrier.cluster: the pair's barriers set up before either CTA uses them)": r"UCGABAR_(ARV|WAIT)\b"}),
    Claim("no_local_memory", 1, None, absent={"LDL (a load from local memory)": r"LDL\b",
                                              "STL (a store to local memory)": r"STL\b"},
          counterexample=LOCAL_MEMORY_CU, part="all"),
    # The backward's kernels (bwd_*), Part III.
    Claim("backward_mma_sync", 24, 36, part="backward",
          present={"HMMA (the backward's products on the tensor cores, mma.sync)": r"HMMA\.",
                   "LDSM (their fragments from shared memory, ldmatrix)": r"LDSM\."}),
    Claim("dq_accumulated", 25, 32, part="backward",
          present={"REDG.E.ADD.F32x2 (atomicAdd of float2: dQ's partial sums added to the fp32 accumulator)":
                   r"REDG\.E\.ADD\.F32x2\b"}),
    Claim("backward_loads_under_products", 26, 28, part="backward",
          present={"LDGSTS (cp.async: the next query tile's Q and dO, global -> shared)": r"LDGSTS\b",
                   "DEPBAR.LE SB0, 0x1 (cp.async.wait_group 1: this tile's copies waited for, the next one's in flight)":
                   r"DEPBAR\.LE\s+SB0,\s*0x1\b"}),
    Claim("backward_wgmma", 28, None, part="backward",
          present={"HGMMA.64x64x16 or 64x80x16 (S^T = K Q^T, dP^T = V dO^T and dQ on wgmma, operands by descriptor)":
                   r"HGMMA\.64x(64|80)x16\.",
                   "HGMMA.64x128x16 with A in registers (dV += P^T dO, dK += dS^T Q)":
                   r"HGMMA\.64x128x16\.\S+\s+R\d+,\s*R\d+,",
                   "gdesc[...].tnspA (dQ's product: an operand read from shared memory transposed)":
                   r"HGMMA\.\S+\s+R\d+,\s*gdesc\[\w+\]\.tnspA"}),
    Claim("backward_query_tiles_of_80", 38, None, part="backward",
          present={"HGMMA.64x80x16 (S^T, dP^T and dQ^T over a tile of 80 queries)": r"HGMMA\.64x80x16\.",
                   "STSM.16.MT88.4 (stmatrix .trans: dS stored [queries, keys] from dS^T's fragments)":
                   r"STSM\.16\.MT88\.4\b"},
          # (over 64 queries S^T, dP^T and dQ^T read both operands by descriptor; from step42 on, at head dim 64, dV
          # and dK are 64x64x16 with their A from registers, N the 64 dims)
          absent={"HGMMA.64x64x16 from shared memory (a product over 64 queries)": r"HGMMA\.64x64x16\.\S+\s+R\d+,\s*gdesc"}),
    Claim("dq_reduced_by_tma", 33, None, part="backward",
          present={"UTMAREDG (cp.reduce.async.bulk.tensor .add: a staged tile of dQ added to the accumulator by TMA)":
                   r"UTMAREDG\b"},
          absent={"REDG.E.ADD.F32x2 (per-thread atomics of dQ's partial sums)": r"REDG\.E\.ADD\.F32x2\b"}),
    Claim("backward_warp_roles", 36, None, part="backward",
          present={"USETMAXREG.DEALLOC (setmaxnreg.dec: the backward's producer warpgroup gives registers up)":
                   r"USETMAXREG\.DEALLOC\b",
                   "USETMAXREG.TRY_ALLOC (setmaxnreg.inc: its consumers take them)": r"USETMAXREG\.TRY_ALLOC\b",
                   "BAR.SYNC 0x1 (a named barrier: the consumers alone meet once a tile)": r"BAR\.SYNC\S*\s+0x1\b"}),
    Claim("backward_tma", 29, None, part="backward",
          present={"UTMALDG (cp.async.bulk.tensor: the backward's Q, dO, K and V tiles by TMA)": r"UTMALDG\b",
                   "SYNCS.PHASECHK (mbarrier.try_wait.parity: a slot's tiles waited for)": r"SYNCS\.PHASECHK\b"},
          absent={"LDGSTS (cp.async, per-thread copies)": r"LDGSTS\b"}),
]


@dataclass(frozen=True)
class Instruction:
    function: str
    address: str
    text: str  # MNEMONIC.MODIFIERS operands
    arch: str = "?"  # the fatbin section's: sm_80, sm_90a, ...

    def __str__(self):
        return f"/*{self.address}*/ {self.text} (in {self.function}, {self.arch})"


FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
ARCH = re.compile(r"^\s*arch\s*=\s*(\S+)")  # cuobjdump's header of a fatbin section: `arch = sm_86`
# `/*0a30*/   @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;   /* 0x... */`
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][^;]*?)\s*;")


def parse_sass(text: str) -> list[Instruction]:
    function, arch, out = "?", "?", []
    for line in text.splitlines():
        if m := ARCH.match(line):
            function, arch = "?", m.group(1)
        elif m := FUNCTION.match(line):
            function = m.group(1)
        elif m := INSTRUCTION.match(line):
            out.append(Instruction(function, m.group(1), re.sub(r"\s+", " ", m.group(2)), arch))
    return out


def parse_ptx(text: str) -> dict[str, str]:
    """`cuobjdump -ptx`'s output -> {arch of the section: its PTX}, the PTX from `.version` on (the section headers,
    which name the file the build came from, left out)."""
    sections, arch, lines = {}, None, None
    for line in text.splitlines() + ["Fatbin"]:
        if line.startswith("Fatbin"):
            if arch and lines:
                sections[arch] = "\n".join(lines).strip() + "\n"
            arch, lines = None, None
        elif (m := ARCH.match(line)) and lines is None:
            arch = m.group(1)
        elif line.startswith(".version"):
            lines = [line]
        elif lines is not None:
            lines.append(line)
    return sections


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


def run_cuobjdump(tool: str, binary: str, what: str = "-sass") -> subprocess.CompletedProcess:
    """`cuobjdump -sass BINARY` (or -ptx). cuobjdump calls nvdisasm, which it looks for on PATH only: the directory
    of the cuobjdump found goes first on PATH (the nvidia-cuda-nvdisasm wheel puts nvdisasm beside it)."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")])}
    return subprocess.run([tool, what, binary], capture_output=True, text=True, env=env)


@functools.lru_cache(maxsize=None)
def _sass_text(tool: str, binary: str, mtime_ns: int) -> str:
    """`cuobjdump -sass`'s output, once per build of a binary (a library of five architectures takes seconds)."""
    proc = run_cuobjdump(tool, binary)
    assert proc.returncode == 0, f"{tool} -sass {binary} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@functools.lru_cache(maxsize=None)
def _sass(tool: str, binary: str, mtime_ns: int) -> tuple[Instruction, ...]:
    text = _sass_text(tool, binary, mtime_ns)
    sass = parse_sass(text)
    # An empty parse would make every "absent" part of a claim pass: refuse it.
    assert sass, f"no SASS instruction read from `{tool} -sass {binary}`; its output begins:\n{text[:2000]}"
    return tuple(sass)


def sass_of(tool: str, binary: Path, arch: str | None = None) -> list[Instruction]:
    """The binary's SASS: every architecture's, or `arch`'s alone."""
    return [i for i in _sass(tool, str(binary), binary.stat().st_mtime_ns) if arch is None or i.arch == arch]


@functools.lru_cache(maxsize=None)
def _ptx(tool: str, binary: str, mtime_ns: int) -> dict[str, str]:
    proc = run_cuobjdump(tool, binary, "-ptx")
    assert proc.returncode == 0, f"{tool} -ptx {binary} failed:\n{proc.stdout}{proc.stderr}"
    return parse_ptx(proc.stdout)


def ptx_of(tool: str, binary: Path) -> dict[str, str]:
    """The PTX embedded in the binary: {section arch (sm_80 for compute_80's PTX): text}."""
    return _ptx(tool, str(binary), binary.stat().st_mtime_ns)


def kernel_so(step: str) -> Path:
    return steps_mod.DEV / "flashladder" / step / "_kernel.so"


def step_number(step: str) -> int:
    return int(step[len("step"):])


def pytest_generate_tests(metafunc):
    if "step_claim" in metafunc.fixturenames:  # every claim of a step, on every architecture it has SASS for
        cases = [(s, c, arch) for s in selected_steps() for c in CLAIMS if c.covers(step_number(s))
                 for arch in steps_mod.targets(s).sass()]
        metafunc.parametrize("step_claim", cases, ids=[f"{s}-{c.name}-{arch}" for s, c, arch in cases])
    if "portable_step" in metafunc.fixturenames:  # the steps that embed PTX for the driver to compile
        metafunc.parametrize("portable_step", steps_mod.portable_steps(selected_steps()))


def test_sass_shows_the_claim(step_claim, built, cuobjdump):
    step, claim, arch = step_claim
    sass = sass_of(cuobjdump, kernel_so(step), arch)
    assert sass, f"{step}: no {arch} SASS in {kernel_so(step)}, which the step's targets promise"
    problems = claim.problems(claim.kernels(sass))
    assert not problems, f"{step} on {arch} ({claim.name}, claimed from step{claim.first:02d} on): " + "; ".join(problems)


def test_the_library_holds_the_code_its_targets_name(step, built, cuobjdump):
    """SASS for exactly the architectures of the step's targets (cuobjdump's sections), PTX for exactly its virtual
    ones, and the library says the same (flashladder_archs, which the binding checks against the GPU)."""
    import ctypes
    targets, so = steps_mod.targets(step), kernel_so(step)
    with_sass = sorted({i.arch for i in _sass(cuobjdump, str(so), so.stat().st_mtime_ns)} if targets.sass() else set())
    assert with_sass == sorted(targets.sass()), f"{step}: SASS for {with_sass}, its targets name {targets.sass()}"
    with_ptx = sorted(ptx_of(cuobjdump, so))
    assert with_ptx == sorted(p.replace("compute_", "sm_") for p in targets.ptx()), \
        f"{step}: PTX sections {with_ptx}, its targets name {targets.ptx()}"
    exported = ctypes.CDLL(str(so)).flashladder_archs
    exported.restype = ctypes.c_char_p
    assert exported().decode().split(",") == targets.archs()
    # Each SASS was compiled from the PTX the targets say (the ELF records it: the ptxVersion the driver reports
    # for it, which test_steps_gpu.py's test_the_driver_runs_the_code_the_gpu_should_get expects).
    from_ptx = virtual_archs(_sass_text(cuobjdump, str(so), so.stat().st_mtime_ns)) if targets.sass() else {}
    assert from_ptx == {a: build_step.arch_number(targets.ptx_source(a)) for a in targets.sass()}, from_ptx


def virtual_archs(sass_text: str) -> dict[str, int]:
    """{arch: the virtual architecture its SASS came from} from the `.headerflags @"... EF_CUDA_VIRTUAL_SM(EF_CUDA_SM80)"`
    line of each section of `cuobjdump -sass`."""
    out, arch = {}, None
    for line in sass_text.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
        elif arch and (m := re.search(r"EF_CUDA_VIRTUAL_SM\(EF_CUDA_SM(\d+)\)", line)):
            out[arch] = int(m.group(1))
    return out


def test_the_ptx_jit_build_carries_the_shipped_ptx(portable_step, built, cuobjdump):
    """python -m verify --ptx-jit checks a build of the step's PTX alone (the driver must compile it at load): its
    PTX is the one the step's library ships for the GPUs without SASS of their own, byte for byte."""
    step = portable_step
    if steps_mod.ptx_jit():
        pytest.skip("FLASHLADDER_PTX_JIT: this session's build is the PTX-only one; the normal run compares the two")
    jit = steps_mod.ROOT / "build" / "ptx-jit" / "flashladder" / step  # where --ptx-jit builds it (cached there)
    build_step.compile_step(steps_mod.step_dir(step), jit, ptx_only=True)
    shipped, alone = ptx_of(cuobjdump, kernel_so(step)), ptx_of(cuobjdump, jit / "_kernel.so")
    assert shipped and alone.keys() == shipped.keys(), f"{step}: PTX sections {sorted(alone)} vs {sorted(shipped)}"
    names = re.compile(r"_GLOBAL__N__[0-9a-f]+_")  # the anonymous namespace's hash may follow the flags
    for arch in shipped:
        assert names.sub("_GLOBAL__N__", alone[arch]) == names.sub("_GLOBAL__N__", shipped[arch]), \
            f"{step}: the PTX-only build's {arch} PTX differs from the one the step ships"


# Where the driver compiles a portable step's PTX in the PTX-JIT check: the H200 (sm_90). (A GPU newer than every SASS
# of the library, a B200 for one, compiles the same PTX; sm_100 is left out to spare CI the time.) ptxas here is the
# toolkit's; a driver's JIT is the ptxas of the driver's own CUDA version.
JIT_ARCHS = ("sm_90",)


@pytest.mark.parametrize("jit_arch", JIT_ARCHS)
def test_the_embedded_ptx_compiles_without_spills_where_a_driver_compiles_it(portable_step, built, cuobjdump, jit_arch,
                                                                             tmp_path):
    step = portable_step
    for arch, text in ptx_of(cuobjdump, kernel_so(step)).items():
        src = tmp_path / f"{arch}.ptx"
        src.write_text(text)
        proc = subprocess.run([build_step.find_nvcc(), "-cubin", f"-arch={jit_arch}", "-Xptxas", "-v", str(src),
                               "-o", str(tmp_path / "out.cubin")], capture_output=True, text=True)  # nvcc's own ptxas
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = build_step.parse_ptxas(proc.stdout + proc.stderr)
        assert report.get(jit_arch), f"{step}: no kernel in ptxas's report:\n{proc.stderr}"
        for kernel, res in report[jit_arch].items():
            assert res.get("spill_stores") == 0 and res.get("spill_loads") == 0, \
                f"{step} {kernel}: its {arch} PTX spills compiled for {jit_arch}: {res}"


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
    assert all(i.arch == "?" for i in parse_sass(text))
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
    problems = claim.problems(claim.kernels(sass_of(cuobjdump, binary)))
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


def test_longest_chains_follows_the_registers():
    text = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R1, R2, R3, !PT", "FMNMX R4, R5, R6, !PT", "FMNMX R1, R1, R4, !PT",
            "MOV R4, R7", "FMNMX R8, R1, R9, !PT", "FMNMX R10, R4, R11, !PT", "MUFU.EX2 R12, R8",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMNMX R1, R2, R3, !PT", "MUFU.EX2 R4, R1",
            "FMNMX R1, R1, R1, !PT"]  # outside every stretch: not counted
    sass = [Instruction("k", f"{i:04x}", s) for i, s in enumerate(text)]
    claim = next(c for c in CLAIMS if c.name == "short_row_max")
    _, start, end, inner, _ = claim.chain
    # R1 (1) -> R1 (2) -> R8 (3); R4 is rewritten by the MOV, so R10's chain starts again (1)
    assert longest_chains(sass, start, end, inner) == [3, 1]
    assert claim.problems(sass) == []
    long = [Instruction("k", "0000", "WARPGROUP.DEPBAR.LE gsb0, 0x1")]
    long += [Instruction("k", f"{i:04x}", "FMNMX R1, R1, R2, !PT") for i in range(1, 10)]
    long += [Instruction("k", "000a", "MUFU.EX2 R3, R1")]
    assert claim.problems(long) == [f"not {claim.chain[0]}: a chain of 9 in k (at most 8)"]
    # A function whose wgmma is 176 wide may have chains of 10, not 11.
    wide = [Instruction("w", "0000", "HGMMA.64x176x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0")]
    wide += [Instruction("w", f"{i:04x}", "WARPGROUP.DEPBAR.LE gsb0, 0x1") for i in range(1, 2)]
    wide += [Instruction("w", f"{i:04x}", "FMNMX R1, R1, R2, !PT") for i in range(2, 12)]
    wide += [Instruction("w", "000c", "MUFU.EX2 R3, R1")]
    assert row_max_chain_limit(wide) == 10 and claim.problems(wide) == []
    wide.insert(2, Instruction("w", "0001", "FMNMX R1, R1, R2, !PT"))
    assert claim.problems(wide) == [f"not {claim.chain[0]}: a chain of 11 in w (at most 10)"]


def test_sass_parser_reads_each_architectures_section():
    """cuobjdump -sass prints one section per architecture; each instruction is the section's."""
    text = """
Fatbin elf code:
================
arch = sm_80
code version = [1,8]

	code for sm_80
		Function : kernel_a
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x0000000c0804723c */

Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

	code for sm_90a
		Function : kernel_a
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
"""
    got = [(i.arch, i.function, i.text) for i in parse_sass(text)]
    assert got == [("sm_80", "kernel_a", "LDC R1, c[0x0][0x28]"), ("sm_80", "kernel_a", "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
                   ("sm_90a", "kernel_a", "LDC R1, c[0x0][0x28]")]


def test_ptx_parser_reads_each_section():
    text = """
Fatbin elf code:
================
arch = sm_80
identifier = a/kernel.cu

Fatbin ptx code:
================
arch = sm_80
compressed
identifier = a/kernel.cu

.version 9.0
.target sm_80
.entry k()
{
}

Fatbin elf code:
================
arch = sm_90a
"""
    assert parse_ptx(text) == {"sm_80": ".version 9.0\n.target sm_80\n.entry k()\n{\n}\n"}


def kernel_opcodes(cuobjdump, steps: tuple) -> dict[str, dict[str, collections.Counter]]:
    """{step: {mangled kernel name: its sm_90a opcodes, counted}} for steps built here (skipped where one is missing)."""
    if not set(steps) <= set(steps_mod.all_steps()):
        pytest.skip(f"one of {', '.join(steps)} is not in this tree")
    steps_mod.build(list(steps), log=lambda *_: None)
    return {s: {name: collections.Counter(i.text.split()[0] for i in code)
                for name, code in functions_of(sass_of(cuobjdump, kernel_so(s), "sm_90a")).items()} for s in steps}


def kernel_code(cuobjdump, steps: tuple) -> dict[str, dict[str, list[str]]]:
    """{step: {mangled kernel name: its sm_90a instructions in order, operands included}}: for the claim that a kernel
    is another step's as it was, where counting opcodes would miss two instructions swapped."""
    if not set(steps) <= set(steps_mod.all_steps()):
        pytest.skip(f"one of {', '.join(steps)} is not in this tree")
    steps_mod.build(list(steps), log=lambda *_: None)
    return {s: {name: [i.text for i in code] for name, code in functions_of(sass_of(cuobjdump, kernel_so(s), "sm_90a")).items()}
            for s in steps}


def first_difference(a: list[str], b: list[str]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{len(a)} and {len(b)} instructions, first apart at {at}: {a[at:at + 1]} / {b[at:at + 1]}"


def apart(a: collections.Counter, b: collections.Counter) -> collections.Counter:
    return (a - b) + (b - a)


def kernel(opcodes: dict[str, collections.Counter], marker: str) -> collections.Counter:
    return next(c for name, c in opcodes.items() if "attention_fwd_kernel" + marker in name)


@pytest.mark.parametrize("later", ["step16", "step17", "step18", "step19"])
def test_the_kernel_of_one_cta_per_cluster_is_step15s(later, cuobjdump):
    """Steps 16, 17, 18 and 19 change the paired kernel alone (their headers say so): attention_fwd_kernel<false> compiles to
    step15's kernel, opcode for opcode (ptxas schedules and allocates registers its own way: the order and the registers
    may differ, the counts of each opcode by at most the few moves it needs), and <true> is another code."""
    ops = kernel_opcodes(cuobjdump, ("step15", later))
    old, solo, paired = kernel(ops["step15"], ""), kernel(ops[later], "ILb0E"), kernel(ops[later], "ILb1E")
    assert sum(apart(solo, old).values()) <= 8, f"{later}'s <false> differs from step15's kernel: {apart(solo, old)}"
    assert sum(apart(paired, old).values()) > 100  # the test tells two different kernels apart


def test_the_paired_kernel_builds_its_descriptors_once_step17(cuobjdump):
    """step17's header says the paired kernel's steady loop builds no wgmma descriptor per k-step and keeps the
    warpgroup's index in a uniform register: the moves from the vector registers to the uniform ones (R2UR) fall by at
    least 30 against step16's paired kernel (with nvcc 13.0, 50), and the kernel is shorter."""
    ops = kernel_opcodes(cuobjdump, ("step16", "step17"))
    old, new = kernel(ops["step16"], "ILb1E"), kernel(ops["step17"], "ILb1E")
    assert new["R2UR"] <= old["R2UR"] - 30, f"R2UR {old['R2UR']} -> {new['R2UR']}"
    assert sum(new.values()) < sum(old.values()), f"{sum(old.values())} -> {sum(new.values())} instructions"


def ex2_under_pv(cuobjdump, step: str, marker: str) -> list[int]:
    """The MUFU.EX2 of each stretch from a wgmma.wait_group 1 to the next wait_group 0 in the step's kernel `marker`."""
    steps_mod.build([step], log=lambda *_: None)
    code = next(c for name, c in functions_of(sass_of(cuobjdump, kernel_so(step), "sm_90a")).items()
                if "attention_fwd_kernel" + marker in name)
    return stretch_counts(code, r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b", r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", r"MUFU\.EX2\b")


@pytest.mark.parametrize("which, most", [("step17", 70), ("step18", 40)])
def test_the_paired_kernel_splits_its_rows_around_the_pv_wait(which, most, cuobjdump):
    """step18's header says the paired kernel runs one row's exponentials under its P V and the other's after the wait:
    each stretch of its code from a wgmma.wait_group 1 to the next wait_group 0 holds at least 32 MUFU.EX2 (a row's 32,
    with nvcc 13.0 34 with the rescale factors) and at most 40, where step17's paired kernel holds both rows' 64 (66)."""
    counts = ex2_under_pv(cuobjdump, which, "ILb1E")
    assert counts and min(counts) >= 32 and max(counts) <= most, f"{which}: MUFU.EX2 under P V {counts}"
    if which == "step17":
        assert max(counts) > 40, f"step17's paired kernel: {counts} (the test tells the two orders apart)"


def test_the_kernels_without_the_split_are_step19s(cuobjdump):
    """step20's header says the calls it does not split run step19's kernels: attention_fwd_kernel<PAIRED, false>
    compiles to step19's attention_fwd_kernel<PAIRED>, both, to the instruction count and but for a few opcodes (the
    loop's bounds, which the pieces' iterator leaves as moves and selects ptxas keeps); <PAIRED, true>, the split, is
    another code."""
    ops = kernel_opcodes(cuobjdump, ("step19", "step20"))
    for paired in "01":
        old = kernel(ops["step19"], f"ILb{paired}EE")
        same, split = kernel(ops["step20"], f"ILb{paired}ELb0E"), kernel(ops["step20"], f"ILb{paired}ELb1E")
        assert abs(sum(same.values()) - sum(old.values())) <= 8 and sum(apart(same, old).values()) <= 24, \
            f"step20's <{paired}, false> differs from step19's <{paired}>: {apart(same, old)}"
        assert sum(apart(split, old).values()) > 500  # the test tells the split kernel apart


def test_each_kernel_is_built_for_dense_or_causal_calls_step21(cuobjdump):
    """step21's header says each kernel is built for dense calls or for causal ones, p.causal a constant in it: the
    dense kernels <PAIRED, SPLIT, false> at least 5% shorter than step20's <PAIRED, SPLIT> (with nvcc 13.0, 6 to 10%),
    whose code tests p.causal, and the causal ones <PAIRED, false, true> shorter than step20's <PAIRED, false>."""
    ops = kernel_opcodes(cuobjdump, ("step20", "step21"))
    for paired in "01":
        for split in "01":
            before, dense = kernel(ops["step20"], f"ILb{paired}ELb{split}EE"), kernel(ops["step21"], f"ILb{paired}ELb{split}ELb0EE")
            assert sum(dense.values()) <= 0.95 * sum(before.values()), \
                f"step21's dense <{paired}, {split}> has {sum(dense.values())} instructions, step20's {sum(before.values())}"
        before, causal = kernel(ops["step20"], f"ILb{paired}ELb0EE"), kernel(ops["step21"], f"ILb{paired}ELb0ELb1EE")
        assert sum(causal.values()) < sum(before.values()), \
            f"step21's causal <{paired}> has {sum(causal.values())} instructions, step20's {sum(before.values())}"


# An integer division by a number known only at run time: a reciprocal of it converted to float and back
# (I2F.U32.RP or I2F.RP, then F2I), or the absolute values of a signed one (IABS).
INTEGER_DIVISION = r"I2F\.(U32\.)?RP\b|IABS\b"


def test_the_work_tiles_divide_by_multiplying_and_the_epilogue_takes_the_mufu(cuobjdump):
    """step22's header says no kernel divides integers (each divisor's magic number made on the host) and its epilogue's
    1 / l and log l come from the MUFU unit: in each kernel no integer division (INTEGER_DIVISION) where step21's same
    kernel has some, two MUFU.LG2 (the two rows' log; step21's logf has none) and two MUFU.RCP."""
    ops = kernel_opcodes(cuobjdump, ("step21", "step22"))
    for name in (f"ILb{paired}ELb{split}ELb{causal}EE" for paired in "01" for split, causal in ("00", "10", "01")):
        old, new = kernel(ops["step21"], name), kernel(ops["step22"], name)
        divisions = lambda c: sum(n for op, n in c.items() if re.match(INTEGER_DIVISION, op))  # noqa: E731
        assert divisions(old) > 0 and divisions(new) == 0, f"{name}: integer divisions {divisions(old)} -> {divisions(new)}"
        assert old["MUFU.LG2"] == 0 and new["MUFU.LG2"] == 2, f"{name}: MUFU.LG2 {old['MUFU.LG2']} -> {new['MUFU.LG2']}"
        assert new["MUFU.RCP"] == 2, f"{name}: MUFU.RCP {old['MUFU.RCP']} -> {new['MUFU.RCP']}"


def is_dkdv(name: str, first: str) -> bool:
    """Whether `name` is the dK/dV kernel's build with first template argument `first` ("0" or "1") and, where it has a
    second (step39's FROM_LAST), that one false: bwd_dkdv_kernel<first> or <first, false>."""
    return f"bwd_dkdv_kernelILb{first}EE" in name or f"bwd_dkdv_kernelILb{first}ELb0EE" in name


def dkdv_kernels(opcodes: dict[str, collections.Counter]) -> list[collections.Counter]:
    """The dK/dV kernel's two builds: without and with the dQ accumulation (bwd_dkdv_kernel<false>, <true>; from
    step37 on <true> is the deterministic build, from step39 on <true, false> its dense one)."""
    return [next(c for name, c in opcodes.items() if is_dkdv(name, first)) for first in "01"]


def dkdv_text(cuobjdump, step: str) -> list[str]:
    """The instructions of the dK/dV kernel that accumulates dQ (bwd_dkdv_kernel<true>), as text."""
    return [i.text for name, code in functions_of(sass_of(cuobjdump, kernel_so(step), "sm_90a")).items()
            if is_dkdv(name, "1") for i in code]


def test_the_dkdv_kernel_takes_p_by_one_ffma_and_one_ex2_step30(cuobjdump):
    """step30's header says P^T is one FFMA and one ex2 an element and the masks a branch per warp: in both builds of
    the dK/dV kernel, expf's range reduction (FFMA.RM, one per exponential: 32 in step29) is gone, the exponentials
    stay 32 MUFU.EX2, the per-element branches' BSSY fall by at least 25 (step29: 40 and 42), and the kernel is
    shorter by at least 300 instructions (with nvcc 13.0, about 470)."""
    ops = kernel_opcodes(cuobjdump, ("step29", "step30"))
    for old, new in zip(dkdv_kernels(ops["step29"]), dkdv_kernels(ops["step30"])):
        assert old["FFMA.RM"] >= 32 and new["FFMA.RM"] == 0, f"FFMA.RM {old['FFMA.RM']} -> {new['FFMA.RM']}"
        assert new["MUFU.EX2"] == old["MUFU.EX2"] == 32, f"MUFU.EX2 {old['MUFU.EX2']} -> {new['MUFU.EX2']}"
        assert new["BSSY"] <= old["BSSY"] - 25, f"BSSY {old['BSSY']} -> {new['BSSY']}"
        assert sum(new.values()) <= sum(old.values()) - 300, f"{sum(old.values())} -> {sum(new.values())} instructions"


def test_the_dkdv_kernel_builds_its_descriptors_once_step31(cuobjdump):
    """step31's header says the dK/dV kernel's descriptors are built once and advanced: the masks and shifts that
    encode a descriptor from an address (LOP3 / ULOP3 with 0x3fc.. and 0x10000, SHF / USHF) fall by at least 60 in
    each build (with nvcc 13.0, about 110 and 160), and the kernel is shorter by at least 90 instructions (96 and 144)."""
    ops = kernel_opcodes(cuobjdump, ("step30", "step31"))
    encode = lambda c: sum(n for op, n in c.items() if op.split(".")[0] in ("LOP3", "ULOP3", "SHF", "USHF"))  # noqa: E731
    for old, new in zip(dkdv_kernels(ops["step30"]), dkdv_kernels(ops["step31"])):
        assert encode(new) <= encode(old) - 60, f"LOP3 / ULOP3 / SHF / USHF {encode(old)} -> {encode(new)}"
        assert sum(new.values()) <= sum(old.values()) - 90, f"{sum(old.values())} -> {sum(new.values())} instructions"


def test_the_dq_product_runs_behind_the_next_scores_step32(cuobjdump):
    """step32's header says tile j - 1's dQ = dS K is issued behind tile j's S^T and dP^T, with one block barrier a tile:
    in the dK/dV kernel that accumulates dQ, a wgmma.wait_group 2 appears (S^T waited for with dP^T and dQ still
    running; step31 has none), the block barriers fall by one (step31: the start's and two a tile), and the dQ product
    (HGMMA ...tnspA.tnspB, 8 k-steps) is compiled twice, in the loop and after it for the last tile."""
    ops = kernel_opcodes(cuobjdump, ("step31", "step32"))
    old, new = dkdv_kernels(ops["step31"])[1], dkdv_kernels(ops["step32"])[1]
    text = {s: dkdv_text(cuobjdump, s) for s in ("step31", "step32")}
    wait2 = {s: sum(bool(re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x2\b", t)) for t in ts) for s, ts in text.items()}
    dq = {s: sum(bool(re.match(r"HGMMA\.\S+\s+R\d+,\s*gdesc\[\w+\]\.tnspA\.tnspB", t)) for t in ts) for s, ts in text.items()}
    assert wait2["step31"] == 0 and wait2["step32"] >= 1, wait2
    bar = "BAR.SYNC.DEFER_BLOCKING"
    assert new[bar] == old[bar] - 1, f"block barriers {old[bar]} -> {new[bar]}"
    assert dq["step31"] == 8 and dq["step32"] == 16, dq


def test_the_dq_staging_stores_pick_their_blocks_step34(cuobjdump):
    """step34's header says the lanes with tq / 2 = 1 store block db ^ 2 where the others store db, picked by two FSELs
    a 64-bit store: in the dK/dV kernel that accumulates dQ, step33 has no FSEL and step34 two for each of its STS.64
    (the staging's, in the loop and after it), whose number is step33's."""
    ops = kernel_opcodes(cuobjdump, ("step33", "step34"))
    old, new = dkdv_kernels(ops["step33"])[1], dkdv_kernels(ops["step34"])[1]
    assert old["FSEL"] == 0 and new["STS.64"] == old["STS.64"] > 0, f"FSEL {old['FSEL']}, STS.64 {old['STS.64']} -> {new['STS.64']}"
    assert new["FSEL"] == 2 * new["STS.64"], f"FSEL {new['FSEL']} for {new['STS.64']} STS.64"


def test_the_dq_product_runs_beside_dk_step35(cuobjdump):
    """step35's header says dQ = dS K is issued behind dV and beside dK in its own tile, no longer behind the next
    tile's S^T and dP^T: the wgmma.wait_group 2 that waited for S^T with dP^T and dQ running is gone, and the dQ product
    (HGMMA ...tnspA.tnspB, 8 k-steps) is compiled once, in the loop, where step34 has it twice (after the walk too)."""
    text = {s: dkdv_text(cuobjdump, s) for s in ("step34", "step35")}
    wait2 = {s: sum(bool(re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x2\b", t)) for t in ts) for s, ts in text.items()}
    dq = {s: sum(bool(re.match(r"HGMMA\.\S+\s+R\d+,\s*gdesc\[\w+\]\.tnspA\.tnspB", t)) for t in ts) for s, ts in text.items()}
    assert wait2["step34"] >= 1 and wait2["step35"] == 0, wait2
    assert dq["step34"] == 16 and dq["step35"] == 8, dq


def test_the_producer_warpgroup_reduces_dq_step36(cuobjdump):
    """step36's header says the producer's reducer adds dQ to the accumulator and the consumers meet at a named barrier,
    not a block-wide one: the dK/dV kernel's block barriers fall to one (the start's; step35: three), and its TMA
    reductions are compiled once (4 UTMAREDG, one a 32-dim box), where step35 has them twice (in the loop and after it)."""
    ops = kernel_opcodes(cuobjdump, ("step35", "step36"))
    old, new = dkdv_kernels(ops["step35"])[1], dkdv_kernels(ops["step36"])[1]
    text = {s: dkdv_text(cuobjdump, s) for s in ("step35", "step36")}
    block = {s: sum(bool(re.match(r"BAR\.SYNC\S*\s+0x0\b", t)) for t in ts) for s, ts in text.items()}
    assert block["step35"] == 3 and block["step36"] == 1, block
    assert old["UTMAREDG.4D.ADD"] == 8 and new["UTMAREDG.4D.ADD"] == 4, f"UTMAREDG {old['UTMAREDG.4D.ADD']} -> {new['UTMAREDG.4D.ADD']}"


def test_deterministic_calls_add_dq_in_turn_step37(cuobjdump):
    """step37's header says a deterministic call runs the dK/dV kernel with the reducer waiting for its turn, and every
    other call step36's kernel: bwd_dkdv_kernel<false> compiles to step36's <true>, opcode for opcode; <true> adds the
    turn's acquire loop (LDG.E.STRONG.GPU, NANOSLEEP) and release (STG.E.STRONG.GPU); step24's dQ kernel is gone."""
    ops = kernel_opcodes(cuobjdump, ("step36", "step37"))
    old = dkdv_kernels(ops["step36"])[1]
    plain, ordered = dkdv_kernels(ops["step37"])
    assert not apart(plain, old), f"step37's <false> differs from step36's <true>: {apart(plain, old)}"
    assert ordered["NANOSLEEP"] == 1 and ordered["LDG.E.STRONG.GPU"] >= 1 and ordered["STG.E.STRONG.GPU"] == 1, ordered
    assert any("bwd_dq_kernel" in n for n in ops["step36"]) and not any("bwd_dq_kernel" in n for n in ops["step37"])


def test_the_backward_walks_tiles_of_80_queries_step38(cuobjdump):
    """step38's header says the dK/dV kernel walks tiles of 80 queries, dQ computed transposed from dS stored by
    stmatrix .trans: in both builds, the 64x64x16 products (8 S^T, 8 dP^T, 8 dQ) become 64x80x16 ones (the same 24;
    dQ^T's 8 with K read transposed, .tnspA alone), dV's and dK's k-steps grow from 4 to 5 each, dS's 16 32-bit stores
    a warp become 5 stmatrix (test_build checks that ptxas serializes no wgmma)."""
    ops = kernel_opcodes(cuobjdump, ("step37", "step38"))
    for old, new in zip(dkdv_kernels(ops["step37"]), dkdv_kernels(ops["step38"])):
        n64 = sum(n for op, n in old.items() if op.startswith("HGMMA.64x64x16"))
        n80 = sum(n for op, n in new.items() if op.startswith("HGMMA.64x80x16"))
        n128 = {k: sum(n for op, n in c.items() if op.startswith("HGMMA.64x128x16")) for k, c in (("old", old), ("new", new))}
        assert n64 == 24 and n80 == 24, f"HGMMA.64x64x16 {n64}, HGMMA.64x80x16 {n80}"
        assert n128 == {"old": 8, "new": 10}, n128
        assert old["STSM.16.MT88.4"] == 0 and new["STSM.16.MT88.4"] == 5, f"STSM {old['STSM.16.MT88.4']} -> {new['STSM.16.MT88.4']}"
    text = dkdv_text(cuobjdump, "step38")
    dqt = sum(bool(re.match(r"HGMMA\.64x80x16\.\S+\s+R\d+,\s*gdesc\[\w+\]\.tnspA\s*,", t)) for t in text)
    assert dqt == 8, f"{dqt} HGMMA.64x80x16 with .tnspA alone"


def test_causal_deterministic_calls_take_turns_from_the_last_key_tile_step39(cuobjdump):
    """step39's header says only deterministic causal calls change, in a third build (FROM_LAST): step39's
    bwd_dkdv_kernel<false, false> and <true, false> compile to step38's <false> and <true>, opcode for opcode, and
    <true, true> has the turn's acquire loop and release as <true> does."""
    ops = kernel_opcodes(cuobjdump, ("step38", "step39"))
    for old, new in zip(dkdv_kernels(ops["step38"]), dkdv_kernels(ops["step39"])):
        assert not apart(old, new), f"step39's build differs from step38's: {apart(old, new)}"
    from_last = [c for name, c in ops["step39"].items() if "bwd_dkdv_kernelILb1ELb1EE" in name]
    assert len(from_last) == 1, [name for name in ops["step39"] if "dkdv" in name]
    assert from_last[0]["NANOSLEEP"] == 1 and from_last[0]["STG.E.STRONG.GPU"] == 1, from_last[0]


def bf16_builds(opcodes: dict[str, collections.Counter]) -> dict[str, collections.Counter]:
    """A step's kernels as a step without fp16 names them: from step40 on each kernel is built for bf16 and fp16, its
    first template argument the type (kernel<__nv_bfloat16, ...>); here its bf16 build alone, that argument dropped.
    From step41 on the forward's kernels take the head dim next (kernel<__nv_bfloat16, 128, ...>): its build at 128."""
    return {name.replace("I13__nv_bfloat16Li128EL", "IL").replace("I13__nv_bfloat16L", "IL").replace("I13__nv_bfloat16E", "IE"): c
            for name, c in opcodes.items() if "6__half" not in name and "Li64E" not in name}


@pytest.mark.parametrize("later", [s for s in steps_mod.all_steps() if int(s[4:]) > 22])
def test_the_backward_steps_keep_step22s_forward(later, cuobjdump):
    """The backward's steps say their forward is step22's, unchanged (a neighbour diff shows only the backward): each
    forward kernel compiles to step22's same kernel, opcode for opcode, and the backward's kernels are the only new ones.
    From step40 on, the kernels' bf16 builds (bf16_builds)."""
    ops = kernel_opcodes(cuobjdump, ("step22", later))
    ops[later] = bf16_builds(ops[later])
    for name in (f"ILb{paired}ELb{split}ELb{causal}EE" for paired in "01" for split, causal in ("00", "10", "01")):
        old, new = kernel(ops["step22"], name), kernel(ops[later], name)
        assert not apart(old, new), f"attention_fwd_kernel{name}: {apart(old, new)}"
    forward = lambda names: [n for n in names if "attention_fwd_kernel" in n]  # noqa: E731
    assert len(forward(ops["step22"])) == len(forward(ops[later])) == len(ops["step22"]) == 6
    added = [n for n in ops[later] if "attention_fwd_kernel" not in n]
    assert added and all("bwd_" in n for n in added), added


# What an fp16 build of a kernel may change of its bf16 build: the MMAs' type (HGMMA's .BF16 suffix; fp16 is the
# unsuffixed default) and the conversions from fp32 (F2FP.BF16 -> F2FP.F16); the delta kernel's loads become fp16
# converted by HADD2.F32 (bf16's are shifts): any opcode of its, in the same count.
def same_but_the_type(bf16: collections.Counter, fp16: collections.Counter) -> collections.Counter:
    """The opcodes that differ between a kernel's bf16 and fp16 builds once the type's names are taken out."""
    def untyped(c):
        return collections.Counter({re.sub(r"\.BF16\b|\.F16\b", "", op): n for op, n in c.items()})
    return apart(untyped(bf16), untyped(fp16))


def comparable(name: str) -> str:
    """A mangled kernel name without what differs from one library to another (the anonymous namespace's hash, the
    substitutions' numbers), and a template whose only argument was the type (bf16_builds) as a plain function."""
    name = re.sub(r"_GLOBAL__N__[0-9a-f]+_\d+_kernel_cu_[0-9a-f]{8}", "", name)
    return re.sub(r"S\d+_", "S_", name).replace("_kernelIEEv9", "_kernelE9")


def test_each_kernel_is_built_for_bf16_and_fp16_step40(cuobjdump):
    """step40's header says each kernel is built twice, for bf16 and fp16, and only the type changes: the bf16 builds
    compile to step39's kernels, instruction for instruction; each fp16 build has its bf16 twin's instructions, in number and kind,
    but for the type of its HGMMAs (all of them) and of its F2FP conversions (all of them); the delta kernel, which
    loads O and dO, only the same count."""
    code = kernel_code(cuobjdump, ("step39", "step40"))
    bf16 = {comparable(name): c for name, c in bf16_builds(code["step40"]).items()}
    step39 = {comparable(name): c for name, c in code["step39"].items()}
    assert sorted(bf16) == sorted(step39), (sorted(bf16), sorted(step39))
    for name, old in step39.items():  # instruction for instruction, in order
        assert old == bf16[name], f"step40's bf16 {name}: {first_difference(old, bf16[name])}"
    ops = kernel_opcodes(cuobjdump, ("step40",))
    halves = {name.replace("I6__halfL", "I13__nv_bfloat16L").replace("I6__halfE", "I13__nv_bfloat16E"): c
              for name, c in ops["step40"].items() if "6__half" in name}
    assert len(halves) == len(bf16) == 11, sorted(halves)
    for name, fp16 in halves.items():
        twin = ops["step40"][name]
        assert sum(fp16.values()) == sum(twin.values()), f"{name}: {sum(twin.values())} -> {sum(fp16.values())}"
        if "bwd_delta_kernel" in name:
            continue
        assert not same_but_the_type(twin, fp16), f"{name}: {same_but_the_type(twin, fp16)}"
        for kind in ("HGMMA", "F2FP"):
            typed = {op: n for op, n in fp16.items() if op.startswith(kind)}
            assert all(".BF16" not in op for op in typed), f"{name}: bf16 {kind} in the fp16 build: {typed}"
            assert sum(typed.values()) == sum(n for op, n in twin.items() if op.startswith(kind)), (name, kind)
        assert sum(n for op, n in twin.items() if op.startswith("HGMMA") or op.startswith("F2FP")) > 0, name


def test_the_head_dim_is_a_template_parameter_step41(cuobjdump):
    """step41's header: the forward's kernels take the head dim (64 or 128) as a template parameter; at 128 they are
    step40's, opcode for opcode (the backward's too); at 64 (one CTA per cluster: no paired build) each holds its twin's
    exponentials and, of its HGMMAs, S = Q K^T over 4 k-steps of 16 where 128 has 8 (at 128 the products' halves are S and
    P V, 8 each per block: S's at 64 are a quarter of 128's total), P V at N = 64 (half of 128's total, as many as there),
    and one TMA copy per tile where 128 has two (the halves of a row)."""
    code = kernel_code(cuobjdump, ("step40", "step41"))
    step40 = {comparable(name): c for name, c in code["step40"].items()}
    at128 = {comparable(name.replace("Li128E", "")): c for name, c in code["step41"].items() if "Li64E" not in name}
    assert sorted(at128) == sorted(step40), (sorted(at128), sorted(step40))
    for name, old in step40.items():  # instruction for instruction, in order
        assert old == at128[name], f"step41's {name} at head dim 128: {first_difference(old, at128[name])}"
    ops = kernel_opcodes(cuobjdump, ("step41",))
    at64 = {name: c for name, c in ops["step41"].items() if "Li64E" in name}
    assert len(at64) == 6 and all("Li64ELb0E" in name for name in at64), sorted(at64)  # bf16, fp16 x dense, split, causal

    def count(c, prefix):
        return sum(n for op, n in c.items() if op.startswith(prefix))
    for name, c in at64.items():
        twin = ops["step41"][name.replace("Li64E", "Li128E")]
        hgmma = count(twin, "HGMMA.64x128x16")
        assert hgmma > 0 and count(twin, "HGMMA.64x64x16") == 0, name
        assert count(c, "HGMMA.64x128x16") == hgmma // 4 and count(c, "HGMMA.64x64x16") == hgmma // 2, (name, c)
        assert count(c, "HGMMA") == count(c, "HGMMA.64x128x16") + count(c, "HGMMA.64x64x16"), name
        assert c["MUFU.EX2"] == twin["MUFU.EX2"] > 0, name
        assert 2 * count(c, "UTMALDG") == count(twin, "UTMALDG") > 0 and 2 * count(c, "UTMASTG") == count(twin, "UTMASTG") > 0, name


def test_the_backward_takes_the_head_dim_step42(cuobjdump):
    """step42's header: the backward's kernels take the head dim (64 or 128) as the forward's do; at 128 every kernel is
    step41's, opcode for opcode (the forward's unchanged); at 64 each dK/dV kernel holds its twin's exponentials, half
    its m64n80 HGMMAs (S^T, dP^T and each warpgroup's dQ^T over half the k-steps) and as many RS ones at N = 64 as its
    twin has at 128 (dV and dK over the tile's 80 queries), half its TMA loads (one 64-column half a tile) and as many
    TMA reductions of dQ (four boxes: two partials of 64 dims at 64)."""
    code = kernel_code(cuobjdump, ("step41", "step42"))
    step41 = {comparable(name): c for name, c in code["step41"].items()}
    at128 = {comparable(name if "attention_fwd" in name else name.replace("Li128EL", "L").replace("Li128EE", "E")): c
             for name, c in code["step42"].items() if "Li64E" not in name or "attention_fwd" in name}
    assert sorted(at128) == sorted(step41), (sorted(at128), sorted(step41))
    for name, old in step41.items():  # instruction for instruction, in order
        assert old == at128[name], f"step42's {name}: {first_difference(old, at128[name])}"
    ops = kernel_opcodes(cuobjdump, ("step42",))
    at64 = {name: c for name, c in ops["step42"].items() if "Li64E" in name and "attention_fwd" not in name}
    assert len(at64) == 2 * 5, sorted(at64)  # bf16, fp16 x delta, convert, dK/dV (dense, deterministic, from the last)

    def count(c, prefix):
        return sum(n for op, n in c.items() if op.startswith(prefix))
    for name, c in at64.items():
        twin = ops["step42"][name.replace("Li64E", "Li128E")]
        if "bwd_dkdv_kernel" not in name:
            continue
        assert count(twin, "HGMMA.64x80x16") > 0 and count(twin, "HGMMA.64x128x16") > 0, name
        assert 2 * count(c, "HGMMA.64x80x16") == count(twin, "HGMMA.64x80x16"), (name, c)
        assert count(c, "HGMMA.64x64x16") == count(twin, "HGMMA.64x128x16") and count(c, "HGMMA.64x128x16") == 0, (name, c)
        assert c["MUFU.EX2"] == twin["MUFU.EX2"] > 0, name
        assert 2 * count(c, "UTMALDG") == count(twin, "UTMALDG") > 0, name
        assert count(c, "UTMAREDG") == count(twin, "UTMAREDG") > 0, name


def test_kernel_flags_reads_the_names_of_every_step_s_kernels():
    """No GPU: test_steps_gpu.kernel_flags, on the names the steps' kernels carry; a name without the flags fails it (before, a
    pattern that no longer matched step40's names was taken for a kernel without CAUSAL, and skipped that check)."""
    from verify.tests.test_steps_gpu import kernel_flags
    sig = "(FwdParams, (anonymous namespace)::Schedule, CUtensorMap_st)"
    assert kernel_flags(f"void (anonymous namespace)::attention_fwd_kernel<true>{sig}") == [True]
    assert kernel_flags(f"void (anonymous namespace)::attention_fwd_kernel<false, true, true>{sig}") == [False, True, True]
    assert kernel_flags(f"void (anonymous namespace)::attention_fwd_kernel<__half, true, false, false>{sig}") == [True, False, False]
    assert kernel_flags(f"void attention_fwd_kernel<__nv_bfloat16, 64, false, false, true>{sig}") == [False, False, True]
    with pytest.raises(AssertionError, match="no PAIRED"):
        kernel_flags(f"void (anonymous namespace)::attention_fwd_kernel{sig}")
