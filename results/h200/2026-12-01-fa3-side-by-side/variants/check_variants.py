"""Checks of kernel variants at shapes with several work tiles per CTA and ragged lengths (float64 reference)."""
import sys
from verify import steps
from verify.checks import make_inputs, measure_errors
bad = 0
for name in sys.argv[1:]:
    mod = steps.load(name)
    shapes = [(4, 16, 1024, 1024), (3, 5, 1000, 777), (1, 40, 777, 1500), (2, 8, 4096, 2048), (1, 1, 1, 1)]
    if "mc" in name:  # CTA pairs on neighbouring Q tiles: an even number of them
        shapes = [(4, 16, 1024, 1024), (3, 5, 1000, 777), (1, 40, 1000, 1500), (2, 8, 4096, 2048), (1, 1, 129, 1)]
    for shape in shapes:
        for factor in (1.0, 10.0):
            err = measure_errors(mod, *make_inputs(*shape, factor=factor))
            f = err.failures()
            bad += bool(f)
            print(f"{name} {shape} x{factor:g}: {'ok' if not f else 'FAILED ' + '; '.join(f)}  (O rel {err.o_rel_frob:.2e})", flush=True)
print("variant checks:", "all passed" if not bad else f"{bad} FAILED")
sys.exit(1 if bad else 0)
