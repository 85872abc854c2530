"""Why the 1K cells of the run of record spread: verify's own timer (measure's warm-up and window) on step14, step18
and FA3 at 16 x 16 x 1024, per-call times kept, NVML's clock-event reasons sampled every 5 ms; with verify's L2 flush
(a 256 MB memset), with a flush that reads 256 MB instead, and with none."""
import json
import os
import statistics
import threading
import time

import pynvml
import torch

from verify import steps as S
from verify.bench import ClockSampler, CudaCalls, L2Flush, SteadyState, Timing, drive, fa3_attention, fit_to_clock

N = int(os.environ.get("N", 1024))


class Reasons:
    def __init__(self):
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.rows, self.stop = [], False

    def __enter__(self):
        def loop():
            while not self.stop:
                try:
                    r = pynvml.nvmlDeviceGetCurrentClocksEventReasons(self.h)
                except AttributeError:
                    r = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.h)
                self.rows.append((time.perf_counter(), r, pynvml.nvmlDeviceGetClockInfo(self.h, pynvml.NVML_CLOCK_SM)))
                time.sleep(0.005)
        self.t = threading.Thread(target=loop, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *a):
        self.stop = True
        self.t.join()

    def between(self, a, b):
        return [r for r in self.rows if a <= r[0] <= b]


def main():
    S.build(["step14", "step18"])
    mods = {n: S.load(n) for n in ("step14", "step18")}
    fa3, why = fa3_attention()
    b, h = 16384 // N, 16
    gen = torch.Generator(device="cuda").manual_seed(N)
    q, k, v = (torch.randn(b, h, N, 128, device="cuda", generator=gen).add_(0.5).to(torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    fns = {"step14": lambda: mods["step14"].attention(q, k, v), "step18": lambda: mods["step18"].attention(q, k, v),
           "fa3": lambda: fa3(qt, kt, vt)}
    memset = L2Flush()
    rbuf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty(1, dtype=torch.int64, device="cuda")
    flushes = {"memset": memset, "read": lambda: torch.sum(rbuf.view(torch.int64), dim=0, out=out), "none": lambda: None}
    timing = Timing(settle_max_s=1.0)
    dump = []
    with ClockSampler() as sampler, Reasons() as reasons:
        timing = fit_to_clock(timing, sampler.interval_s)
        for rep in range(int(os.environ.get("REPS", 2))):
            for fl_name, fl in ((f, flushes[f]) for f in os.environ.get("FLUSHES", "memset,read,none").split(",")):
                order = list(fns.items()) if rep % 2 == 0 else list(reversed(fns.items()))
                for name, fn in order:
                    fn()
                    torch.cuda.synchronize()
                    time.sleep(timing.pause_s)
                    gpu = CudaCalls(fn, fl)
                    st = SteadyState(timing, lambda a, b_, g=gpu: sampler.between(g.host_t0 + a, g.host_t0 + b_))
                    drive(gpu, st, timing.ahead_s)
                    cell = st.summary()
                    win = st.calls[st.first_window:]
                    ms = [(e - s) * 1e3 for _, s, e in win]
                    srt = sorted(ms)
                    p10 = srt[len(srt) // 10]
                    slow = sum(1 for x in ms if x > 1.08 * p10) / len(ms)
                    rs = reasons.between(gpu.host_t0 + win[0][0], gpu.host_t0 + win[-1][2])
                    rset = {}
                    for _, r, _ in rs:
                        rset[hex(r)] = rset.get(hex(r), 0) + 1
                    mhz = [c for _, _, c in rs]
                    print(f"{fl_name:6} {name:7} rep {rep}: median {cell['median_ms'] * 1e3:6.1f} us  mean {statistics.mean(ms) * 1e3:6.1f}"
                          f"  p10 {p10 * 1e3:6.1f}  p90 {srt[9 * len(srt) // 10] * 1e3:6.1f}  slow(>1.08 p10) {slow:4.2f}"
                          f"  nvml {cell['sm_mhz_median']} MHz, 5ms-sampler {min(mhz)}-{statistics.median(mhz)}-{max(mhz)} MHz"
                          f"  {cell['power_w_median']:.0f} W  reasons {rset}", flush=True)
                    dump.append({"flush": fl_name, "impl": name, "rep": rep, "ms": ms,
                                 "t": [s for _, s, _ in win], "reasons": [(t - gpu.host_t0, r, c) for t, r, c in rs]})
    json.dump(dump, open(os.path.join(os.environ.get("OUT", "."), f"bimodal-{N}.json"), "w"))


if __name__ == "__main__":
    main()
