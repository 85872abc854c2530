"""CPU: what the README says is generated, and stays true."""
from pathlib import Path

from verify import report

ROOT = Path(__file__).resolve().parents[2]


def test_readme_lists_every_step():
    text = (ROOT / "README.md").read_text()
    assert report.steps_table(ROOT) in text, \
        "README.md's step list is stale: run `python -m verify --update-steps-table`"


def test_readme_commands_exist():
    text = (ROOT / "README.md").read_text()
    for cmd in ("nox --no-venv -s verify", "nox -s tests", "python -m verify", "pip install steps/step"):
        assert cmd in text, f"README.md no longer shows `{cmd}`"
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "def tests(" in noxfile and "def verify(" in noxfile
    assert "nox -s tests" in (ROOT / ".ci" / "run").read_text(), ".ci/run must call the README's test command"


def test_verify_cli_runs_without_a_gpu():
    """`python -m verify --help` works anywhere (the main job's entry point imports cleanly)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "verify", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--steps" in out.stdout, out.stderr
