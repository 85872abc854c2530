"""Run every selected step once on one shape: for compute-sanitizer and ncu, e.g.

    compute-sanitizer --tool racecheck python -m verify.once --steps 1-6

Each step has a time limit (--timeout). A kernel that hangs (from step08 on, a wait on an mbarrier phase
that never completes) blocks this process in a CUDA call for good and leaves nothing else able to run on
the GPU here; so at the limit the step is reported as FAILED and the process exits (code 1) without
running the steps after it. Exit code 1 also when a step raises or writes a non-finite output.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

from verify import steps as steps_mod

PROG = "python -m verify.once"


def shape_arg(text: str) -> list[int]:
    try:
        shape = [int(x) for x in text.split(",")]
    except ValueError:
        shape = []
    if len(shape) != 4 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"expected four positive numbers batch,heads,seqlen_q,seqlen_k, not {text!r}")
    return shape


def watchdog(step: str, timeout: float) -> threading.Timer:
    """A timer that ends the process if `step` has not finished within `timeout` seconds; cancel() it when done.

    It runs in a thread of its own: torch and ctypes release the GIL while they wait on the GPU."""
    def expire():
        print(f"{step}: FAILED (timed out after {timeout:g} s: a hung kernel?)", flush=True)
        os._exit(1)  # no clean exit: the hung call would never return to let one happen
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv=None) -> int:
    ap = steps_mod.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=steps_mod.steps_arg, help="e.g. 1-6, step03, 2,5 (default: every step)")
    ap.add_argument("--shape", type=shape_arg, default=[2, 2, 512, 256], help="batch,heads,seqlen_q,seqlen_k (default: 2,2,512,256)")
    ap.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                    help="time limit for one step, build excluded; raise it under a slow sanitizer tool (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        ap.error(f"argument --timeout: must be positive, not {args.timeout:g}")
    if why := steps_mod.no_gpu_reason():
        raise SystemExit(f"{PROG}: error: {why}")
    import torch

    from verify.checks import make_inputs
    failed = []
    for step in args.steps or steps_mod.all_steps():
        timer = None
        try:
            steps_mod.build([step], log=lambda *_: None)  # not timed: nvcc is slow, but it never hangs
            timer = watchdog(step, args.timeout)
            mod = steps_mod.load(step)
            q, k, v = make_inputs(*args.shape)
            o, lse = mod.attention(q, k, v)
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(o).all() and torch.isfinite(lse).all())
        except Exception as e:  # the binding's and nvcc's errors say it in their first line; go on with the next step
            print(f"{step}: FAILED ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})", flush=True)
            failed.append(step)
            continue
        finally:
            if timer:
                timer.cancel()
        print(f"{step}: ran {tuple(args.shape)}, finite={finite}", flush=True)
        if not finite:
            failed.append(step)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
