"""In-memory state vs the saved state on disk, for restoring a document's prefilled state (issue 28)."""
import json, statistics, sys, time
from pathlib import Path
import numpy as np
from kvlocal import kvstate
from kvlocal.session import Session

states = Path.home() / ".cache/kvlocal/states"
entries = [e for e in kvstate.list_entries() if "library-s0-doc01" in (e.label or "")]
path = entries[0].path if entries else sorted(states.glob("*.kvstate"))[0]
with open(path, "rb") as fh:
    header = kvstate._read_header(fh)
print("entry:", path.name, header.get("label"), header["n_tokens"], "tokens", header["state_len"] / 2**20, "MiB")
s = Session(None, threads=2, n_ctx=8192)
s.llm = s._new_llama(n_ctx=8192)

def from_disk():
    with open(path, "rb") as fh:
        h = kvstate._read_header(fh)
        tokens = np.frombuffer(fh.read(4 * h["n_tokens"]), dtype="<i4")
        state = fh.read(h["state_len"])
    assert kvstate._body_digest(tokens, state) == h["sha256"]
    return state

disk, mem, read = [], [], []
state = from_disk()
for _ in range(5):
    t = time.perf_counter(); st = from_disk(); t1 = time.perf_counter(); assert s._set_state(st); t2 = time.perf_counter()
    read.append(t1 - t); disk.append(t2 - t)
    t = time.perf_counter(); assert s._set_state(state); mem.append(time.perf_counter() - t)
print(json.dumps({"state_MiB": round(len(state) / 2**20, 1), "disk_read_verify_s": statistics.median(read),
                  "disk_total_s": statistics.median(disk), "memory_s": statistics.median(mem), "n": 5}))
