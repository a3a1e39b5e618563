#!/bin/bash
# CPU seconds each process used during one answer over RPC, against the answer's wall time.
# Two `kvlocal rpc-server`s on 127.0.0.1:50111 and :50112; DOC: any document; extra arguments go to ask.
# usage: docs/experiments/rpc-wire/cpu_seconds.sh DOC [--route full]
doc=$1; shift
pids=$(pgrep -f ggml-rpc-server | tr '\n' ' ')
tick=$(getconf CLK_TCK)
cpu() { awk -v t=$tick '{print ($14+$15)/t}' /proc/$1/stat; }
declare -A before
for p in $pids; do before[$p]=$(cpu $p); done
start=$(date +%s.%N)
/usr/bin/time -f "client: %U user %S sys %e wall" .venv/bin/kvlocal ask "$doc" "Summarise the document." "$@" -n 48 --rpc 127.0.0.1:50111,127.0.0.1:50112 2>&1 >/dev/null | grep -E "client:|answer:|wire"
end=$(date +%s.%N)
for p in $pids; do echo "server $p: $(echo "$(cpu $p) - ${before[$p]}" | bc) cpu s"; done
echo "wall $(echo "$end - $start" | bc)"
