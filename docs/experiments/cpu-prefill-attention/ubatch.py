"""Dense prefill seconds and the KV state's sha256 by ubatch size (a Session's n_batch is its n_ubatch).

    .venv/bin/python docs/experiments/cpu-prefill-attention/ubatch.py 3 512,1024,2048 > bench-results/prefill-fa/ubatch-9k.jsonl

COPIES copies of the sample document (3: 9,041 tokens), each size prefilled twice in alternation, no
cache; one JSON line per prefill.
"""
import hashlib
import json
import sys
import time

from kvlocal.sample import sample_document
from kvlocal.session import Session

copies, sizes = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
text = "\n\n".join([sample_document()] * copies)
for _ in range(2):
    for n_ubatch in sizes:
        session = Session(threads=2, n_batch=n_ubatch)
        start = time.perf_counter()
        loaded = session.load_document(text, label="ubatch", use_cache=False)
        seconds = time.perf_counter() - start
        print(json.dumps({"n_ubatch": n_ubatch, "copies": copies, "n_tokens": loaded.n_tokens, "seconds": seconds,
                          "prefill_s": loaded.seconds,
                          "kv_sha256": hashlib.sha256(session.kv_state()).hexdigest()}), flush=True)
        session.close()
