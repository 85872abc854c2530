"""What a run records of the machine it ran on, and where its results go: the GPU, the driver and its clocks (read
with nvidia-smi, never changed), the versions; results/<gpu>/ and the UTC timestamps that name the files there."""
from __future__ import annotations

import datetime as dt
import platform
import re
import subprocess

from verify import steps as steps_mod


def smi() -> dict:
    """Driver and clocks as nvidia-smi reads them now (read only: the card's settings are never changed)."""
    fields = ["driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        vals = [v.strip() for v in out.split(",")]
        d = dict(zip(fields, vals))
        return {"driver": d.pop("driver_version"), "clocks": d}
    except (OSError, IndexError, subprocess.SubprocessError):
        return {"driver": "unknown", "clocks": {}}


def gpu_meta() -> dict:
    """The GPU, torch and its CUDA and cuDNN, Python, the host, nvcc, the driver and the clocks now: what python -m verify
    records with every results file."""
    import torch
    meta = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "host": platform.node()}
    nvcc = steps_mod.build_step.find_nvcc()
    meta["nvcc"] = ".".join(map(str, steps_mod.build_step.nvcc_version(nvcc)))
    meta.update(smi())
    return meta


def results_folder(gpu_name: str) -> str:
    """results/<this>/ for a GPU: 'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower().replace("nvidia", "")).strip("-") or "gpu"


def utc_stamp() -> str:
    """Now, as the results files are named: 2026-12-03T08-42-01Z."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
