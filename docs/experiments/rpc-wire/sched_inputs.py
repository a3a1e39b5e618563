"""What ggml's scheduler copies to each RPC server for one decode step, full and geometric.

Run with two `kvlocal rpc-server`s up (docs/experiments/rpc-wire.md):

    GGML_SCHED_DEBUG=2 .venv/bin/python docs/experiments/rpc-wire/sched_inputs.py \
        127.0.0.1:50111,127.0.0.1:50112 1024 2>&1 | grep -E "^====|SPLIT #[12]" | grep -oE "^====.*|SPLIT #[12]|[^[]*(kq_mask|mask_row)[^]]*"

The default model, layers split 1:1:1 (this machine, then each server), a 1,024-token prefix of
arbitrary tokens; after each "====" line, the splits of that route's decode step: the servers' splits
and, of the inputs each copies to its server, the mask (a routed layer's view of it is an input too).
"""
import ctypes
import sys

from kvlocal.engine import apply_route, layer_plan, llama_cpp, rpc_devices
from kvlocal.models import resolve_model
from kvlocal.routing import Route

F16 = 1
servers, n_doc = sys.argv[1].split(","), int(sys.argv[2])
m = llama_cpp()


@m.llama_log_callback
def log(level, text, user_data):  # kvlocal silences llama.cpp's log; the scheduler prints through it
    sys.stderr.write(text.decode(errors="replace"))


m.llama_log_set(log, ctypes.c_void_p(0))
model_params = m.llama_model_default_params()
devices = rpc_devices(servers)
device_list = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
model_params.devices = ctypes.cast(device_list, ctypes.c_void_p)
model_path = resolve_model(None).path
n_gpu_layers, shares = layer_plan(28, [1] * (len(servers) + 1))
model_params.n_gpu_layers = n_gpu_layers
split = (ctypes.c_float * 128)(*shares)
model_params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
model = m.llama_model_load_from_file(str(model_path).encode(), model_params)
params = m.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch = n_doc + 256, 512, 512
params.n_threads = params.n_threads_batch = 2
params.flash_attn_type = m.LLAMA_FLASH_ATTN_TYPE_ENABLED
params.type_k = params.type_v = F16
params.kv_centroid_block = 8
ctx = m.llama_init_from_model(model, params)


def decode(tokens: list[int], pos0: int) -> None:
    for start in range(0, len(tokens), 512):
        chunk = tokens[start:start + 512]
        batch = m.llama_batch_init(len(chunk), 0, 1)
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos0 + start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, i == len(chunk) - 1
        assert m.llama_decode(ctx, batch) == 0
        m.llama_batch_free(batch)


decode([(i * 37) % 250 for i in range(n_doc)], 0)
pos = n_doc
for route in (Route(mode="full"), Route(mode="geometric", top_k=3, region=64, keep=0.9, pin=0, shortlist=0)):
    apply_route(ctx, route)
    print(f"==== {route.mode}", file=sys.stderr, flush=True)  # the scheduler prints a graph when it splits it
    decode([11], pos)
    decode([12], pos + 1)
    pos += 2
