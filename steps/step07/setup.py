# The same in every step: compile kernel.cu with nvcc for sm_90a (common/build_step.py does the work).
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent.parent / "common"))
from build_step import setup_step  # noqa: E402

setup_step(here)
