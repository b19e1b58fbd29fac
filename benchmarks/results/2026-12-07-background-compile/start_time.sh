#!/bin/bash
# usage: start_time.sh LABEL ; env DARTREE_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR set by caller
cd "$(git rev-parse --show-toplevel)"
PORT=18400; VP=18401; DP=18402
t0=$(date +%s.%N)
PYTHONPATH=$PWD .venv/bin/python -m services.serve --port $PORT --verifier-metrics-port $VP --drafter-metrics-port $DP > /tmp/start-$1.log 2>&1 &
pid=$!
while ! curl -sf http://127.0.0.1:$PORT/health/ready >/dev/null 2>&1; do sleep 0.5; if ! kill -0 $pid 2>/dev/null; then echo "$1 died"; exit 1; fi; if (( $(echo "$(date +%s.%N) - $t0 > 240" | bc) )); then echo "$1 timeout"; kill $pid; exit 1; fi; done
t1=$(date +%s.%N); echo "$1 ready in $(echo "$t1 - $t0" | bc) s"
curl -s http://127.0.0.1:$PORT/health/ready | head -c 300; echo
sleep ${HOLD:-1}
kill -TERM $pid; wait $pid 2>/dev/null
