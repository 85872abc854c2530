# The same in every step: compile kernel.cu with nvcc for its targets (common/build_step.py does the work).
# common/ is two folders up in the repository, and beside this file in the step's sdist, which carries it.
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
common = next((d for d in (here / "common", here.parent.parent / "common") if (d / "build_step.py").is_file()), None)
if common is None:
    sys.exit(f"{here}: common/build_step.py not found; build a step from the flashladder repository "
             "(pip install steps/<step>) or from its sdist")
sys.path.insert(0, str(common))
from build_step import setup_step  # noqa: E402

setup_step(here)
