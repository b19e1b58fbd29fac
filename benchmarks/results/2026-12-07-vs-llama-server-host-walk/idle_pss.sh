#!/bin/bash
# Idle memory of a default `dartree serve` after load: start it, wait until the compiled step serves,
# send 16 chat requests 8 at a time (128 tokens each), wait 10 s, then sum the PSS (kB, from
# /proc/PID/smaps_rollup) of the server and every process under it. Prints one line per process and the total.
cd "$(git rev-parse --show-toplevel)"
PORT=${PORT:-18600}
PYTHONPATH=$PWD .venv/bin/python -m services.serve --port $PORT --verifier-metrics-port $((PORT+1)) \
    --drafter-metrics-port $((PORT+2)) > /tmp/idle-pss.log 2>&1 &
root=$!
ready() { r=$(curl -sf http://127.0.0.1:$PORT/health/ready) && ! grep -q eager <<< "$r"; }
until ready; do sleep 1; done
req() { curl -s http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' -d \
  "{\"model\":\"smollm2-135m-instruct\",\"messages\":[{\"role\":\"user\",\"content\":\"Question $1: explain how a hash table handles collisions.\"}],\"max_tokens\":128}" > /dev/null; }
for wave in 0 1; do pids=(); for i in $(seq 1 8); do req $wave-$i & pids+=($!); done; wait "${pids[@]}"; done
sleep 10
desc() { echo $1; for c in $(ps -o pid= --ppid $1); do desc $c; done; }
tot=0
for p in $(desc $root); do
  kb=$(awk '/^Pss:/{print $2}' /proc/$p/smaps_rollup 2>/dev/null) || continue
  [ -n "$kb" ] || continue
  printf "%8d kB  %s\n" $kb "$(cat /proc/$p/comm)"; tot=$((tot+kb))
done
echo "total PSS: $((tot/1024)) MB"
kill -TERM $root; wait $root 2>/dev/null
