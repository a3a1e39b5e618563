"""Diagnostic: does routing the question's own steps lose the fact? Question steps dense (all, or all
but the last), answer steps routed; 8k look-alike haystacks, seeds 0-2, facts outside the window."""
import json, sys, time
from kvlocal.session import Session
from kvlocal.routing import RouteConfig, read_stats
from kvlocal.evals.runner import make_case
from kvlocal.evals.tasks import score

length = int(sys.argv[1]); out = sys.argv[2]
variants = sys.argv[3].split(",")  # e.g. qfull-k4, qlast-k4, qfull-k8
seeds = [0, 1, 2]
depths = [round(i / 9, 3) for i in range(10)]
s = Session(None, n_ctx=length, centroid_block=4)
full = RouteConfig(mode="full")

class Switch:
    def __init__(self, n_dense, route):
        self.n_dense, self.route, self.i = n_dense, route, 0

orig_step = Session._step
def step(self, token, want):
    sw = self._switch
    if sw.i == 0:
        (full if sw.n_dense > 0 else sw.route).apply(self.ctx)
    elif sw.i == sw.n_dense:
        sw.route.apply(self.ctx)
    sw.i += 1
    return orig_step(self, token, want)
Session._step = step

with open(out, "a") as fh:
    for seed in seeds:
        case = make_case(s, "lookalike", length, depths, seed)
        s.load_document(case.text, label="qdiag")
        n_tok = s.n_prefix
        for i, probe in enumerate(case.probes):
            pos = probe.depth * n_tok
            if not (64 < pos < n_tok - 128 - 256):
                continue
            for v in variants:
                kind, k = v.split("-")
                route = RouteConfig(top_k=int(k[1:]))
                nq = len(s.tokenize_prompt(s.parts.question_segments(probe.question), bos=False))
                n_dense = {"qfull": nq, "qlast": nq - 1, "base": 0}[kind]
                s._switch = Switch(n_dense, route)
                t = time.time()
                summ = s.answer(probe.question, route=route, max_tokens=24)
                row = dict(length=length, seed=seed, probe=i, depth=probe.depth, variant=v, nq=nq,
                           score=score(probe, summ.text), answer=summ.text.strip(), expected=list(probe.answers),
                           bytes_read=summ.bytes_read, bytes_dense=summ.bytes_dense, steps=summ.steps)
                fh.write(json.dumps(row) + "\n"); fh.flush()
                print(v, seed, i, probe.depth, row["score"], repr(row["answer"]), probe.answers, f"{time.time()-t:.1f}s", flush=True)
