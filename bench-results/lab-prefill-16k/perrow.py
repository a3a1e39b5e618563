import sys, time
from pathlib import Path
from kvlocal.evals import lab_prefill as lp
from kvlocal.evals.lab_rules import Geometry
cap = lp.PrefillCapture.load(Path('bench-results/lab-prefill-16k/prefill-lookalike-16384-s0-d10-from4096.npz'))
t = time.time()
tot = lp.replay_prefill(cap, ["oracle-sum", "engine"], [1, 512], [16, 64], Geometry(), layers=[3, 8, 14, 20, 26])
print(lp.markdown_prefill(lp.summarize_prefill(tot)))
print(time.time() - t, file=sys.stderr)
