import sys, json
from kvlocal.session import Session
from kvlocal.routing import RouteConfig
from kvlocal.evals.runner import make_case
from kvlocal.evals.tasks import score
s = Session(None, n_ctx=8192, centroid_block=4)
tot = {}
cfgs = {f"q{k}": RouteConfig(top_k=4, question="routed", question_top_k=k) for k in map(int, sys.argv[1].split(","))}
out = open("/tmp/diag/q4.jsonl", "a")
for seed in (0, 1, 2):
    case = make_case(s, "lookalike", 8192, [round(i/9,3) for i in range(10)], seed)
    s.load_document(case.text, label="smoke")
    n = s.n_prefix
    for i, probe in enumerate(case.probes):
        if not (64 < probe.depth * n < n - 128 - 256): continue
        for name, r in cfgs.items():
            su = s.answer(probe.question, route=r, max_tokens=24)
            sc = score(probe, su.text); tot.setdefault(name, []).append(sc)
            out.write(json.dumps(dict(seed=seed, probe=i, variant=name, score=sc, answer=su.text.strip(), red=su.reduction)) + "\n"); out.flush()
for k, v in tot.items(): print(k, sum(v), len(v))
