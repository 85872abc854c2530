"""CPU: what the README says is generated, and stays true."""
import re
from pathlib import Path

from verify import capstone, report

ROOT = Path(__file__).resolve().parents[2]


def section(text: str, title: str) -> str:
    """The body of the README's `## title` section."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def commands(markdown: str) -> list[str]:
    """The commands of the bash blocks in `markdown`, comments dropped, `a && b` split."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, re.S)
    return [c.strip() for b in blocks for line in b.splitlines() for c in line.split("#")[0].split("&&") if c.strip()]


def test_readme_lists_every_step():
    text = (ROOT / "README.md").read_text()
    assert report.steps_table(ROOT) in text, \
        "README.md's step list is stale: run `python -m verify --update-steps-table`"


def test_readme_commands_exist():
    text = (ROOT / "README.md").read_text()
    for cmd in ("nox -s verify", "nox -s tests", "python -m verify", "pip install steps/step"):
        assert cmd in text, f"README.md no longer shows `{cmd}`"
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "def tests(" in noxfile and "def verify(" in noxfile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "nox -s tests" in ci, ".ci/run must call the README's test command"
    assert "\nset -euo pipefail\n" in ci, ".ci/run must fail on any failure"


def test_readme_set_up_works_on_a_fresh_machine_and_leads_to_the_commands():
    """Only what a fresh Linux with Python has (git, python3 with venv and pip), then the next section runs nox."""
    text = (ROOT / "README.md").read_text()
    set_up = commands(section(text, "Set up"))
    assert set_up and all(c.split()[0] in {"git", "cd", "python3", ".", "pip"} for c in set_up), set_up
    assert "pip install nox" in set_up, set_up
    after = text.split("\n## Set up\n", 1)[1].split("\n## ", 2)[1]
    assert after.startswith("The main job and the tests\n"), "the set-up's next section must be the one with the commands"
    assert {"nox -s verify", "nox -s tests"} <= set(commands(after)), commands(after)


def test_readme_says_what_installing_a_step_brings():
    """The build needs no torch, the install does: the README names each of a step's dependencies."""
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "steps" / "step01" / "pyproject.toml").read_text(), re.M)
    use = section((ROOT / "README.md").read_text(), "Use a step")
    for dep in re.findall(r'"([^"]+)"', deps.group(1)):
        as_written = dep.replace(">=", " >= ")  # torch>=2.4 reads "torch >= 2.4"
        assert as_written in use, f"the README's 'Use a step' does not say `{as_written}`"


def test_verify_cli_runs_without_a_gpu():
    """`python -m verify --help` works anywhere (the main job's entry point imports cleanly)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "verify", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--steps" in out.stdout, out.stderr


def test_readme_capstone_section_is_generated_from_the_newest_run_of_record():
    """The section between the capstone markers is what `python -m verify.capstone --report` makes of the newest full
    run under results/ (a partial run, --quick or one shape, leaves it as it is), or says that none is recorded."""
    text = (ROOT / "README.md").read_text()
    run = capstone.newest_full_run(ROOT)
    want = f"{capstone.README_BEGIN}\n{capstone.readme_section(run)}\n{capstone.README_END}"
    assert want in text, ("README.md's capstone section is stale: run `python -m verify.capstone --report "
                          f"{run['path'] if run else 'results/<gpu>/capstone-<timestamp>.json'}`")
    section_ = section(text, "The capstone: the final step in a video diffusion model")
    for cmd in ("pip install -r requirements-capstone.txt", "python -m verify.capstone", "--checkpoint", "--tiny-pipeline"):
        assert cmd in section_, f"the capstone section no longer shows `{cmd}`"
