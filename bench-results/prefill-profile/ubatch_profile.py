"""Where a long prefill's time goes: one ubatch of the document at several context positions,
dense and routed, on a saved haystack state (no full prefill needed).

  python bench-results/prefill-profile/ubatch_profile.py [--length 32768] [--seed 0] [--top-k 8,16,32]
      [--positions 0,4096,8192,16384,24576,30208] [--repeat 1] [--kv-type f16|q8_0]

For every position p the cache is cut back to p tokens (llama_memory_seq_rm) and the document's
tokens [p, p + n_batch) are prefilled again, timed: dense (every earlier cell read), then routed to
top-k regions per layer and KV head with the sinks, the window and the ubatch itself. Positions
run from the far end back, so every cut leaves the document's own cells below it. The ubatch at
p = 0 reads (almost) nothing, so t(p) - t(0) is what attention over p earlier tokens costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvlocal.evals.runner import DEFAULT_DEPTHS, make_case
from kvlocal.engine import llama_cpp
from kvlocal.routing import RouteConfig, read_stats
from kvlocal.session import Session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--top-k", default="8,16,32")
    ap.add_argument("--positions", default="0,4096,8192,16384,24576,30208")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--kv-type", default="f16", help="KV cache type (a q8_0 cache prefills its own haystack state)")
    args = ap.parse_args()

    session = Session(n_batch=args.n_batch, threads=args.threads, kv_type=args.kv_type)
    case = make_case(session, args.task, args.length, DEFAULT_DEPTHS, args.seed)
    loaded = session.load_document(case.text, label=f"eval {args.task} {args.length} seed {args.seed}")
    print(f"# {loaded.n_tokens} tokens, {'restored' if loaded.cache_hit else 'prefilled'} in {loaded.seconds:.0f} s, "
          f"threads {session.threads}, n_batch {args.n_batch}, KV {args.kv_type}", file=sys.stderr)
    tokens = [int(t) for t in session.llm.input_ids[: loaded.n_tokens]]
    module = llama_cpp()
    mem = module.llama_get_memory(session.ctx)
    routes = [("dense", RouteConfig(mode="full"), 0)]
    routes += [(f"routed top-{k}", RouteConfig(), k) for k in map(int, filter(None, args.top_k.split(",")))]
    rows = []
    # from the far end back, so each cut leaves the document's own cells below it; one untimed
    # ubatch first (the first graph of a context pays for its allocation)
    positions = sorted({min(int(p), len(tokens) - args.n_batch) for p in args.positions.split(",")}, reverse=True)
    module.llama_memory_seq_rm(mem, 0, positions[0], -1)
    session.llm.n_tokens = positions[0]
    session.llm.eval(tokens[positions[0] : positions[0] + args.n_batch])
    for p in positions:
        for name, route, k in routes:
            best = None
            for _ in range(args.repeat):
                module.llama_memory_seq_rm(mem, 0, p, -1)
                session.llm.n_tokens = p
                route.apply(session.ctx, batch_top_k=k)
                t0 = time.perf_counter()
                session.llm.eval(tokens[p : p + args.n_batch])
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            stats = read_stats(session.ctx, with_regions=False)
            row = {"pos": p, "route": name, "top_k": k, "seconds": round(best, 3),
                   "tok_s": round(args.n_batch / best, 1),
                   "rows_read": stats.rows_read if stats else None, "rows_dense": stats.rows_dense if stats else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["route"]: r["seconds"] for r in rows if r["pos"] == min(x["pos"] for x in rows)}
    print("\n| position | route | s / ubatch | tok/s | attention share (t - t0)/t |", file=sys.stderr)
    print("|---:|---|---:|---:|---:|", file=sys.stderr)
    for r in rows:
        share = (r["seconds"] - base[r["route"]]) / r["seconds"]
        print(f"| {r['pos']:,} | {r['route']} | {r['seconds']:.2f} | {r['tok_s']:.0f} | {share:.0%} |", file=sys.stderr)


if __name__ == "__main__":
    main()
