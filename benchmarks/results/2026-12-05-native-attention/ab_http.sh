#!/bin/bash
# Through HTTP next to llama-cpp-python's server: the default server with the native slot attention
# (native) and with it switched off (python), in the order native python python native.
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/2026-12-05-native-attention
i=0
for arm in native python python native; do
  i=$((i+1))
  if [ $arm = python ]; then export DARTREE_NATIVE_ATTENTION=0; else unset DARTREE_NATIVE_ATTENTION; fi
  top -bn2 -d0.5 | grep Cpu | tail -1 > $OUT/top-http-$i-$arm.txt
  .venv/bin/python benchmarks/results/2026-12-04-ar-vs-llamacpp/ab_http.py --prompts 8 --passes 2 \
      --max-tokens 128 --out $OUT/ab-http-$i-$arm.json > $OUT/ab-http-$i-$arm.log 2>&1
done
