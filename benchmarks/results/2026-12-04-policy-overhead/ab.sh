set -x
D=/work/main/benchmarks/results/2026-12-04-policy-overhead
mkdir -p $D
top -bn1 | head -15 > $D/top-before.txt
for i in 1 2; do
  for arm in old new; do
    if [ $arm = old ]; then root=/tmp/dc/old; else root=/work/main; fi
    (cd $root && PYTHONPATH=$root /work/main/.venv/bin/python -m benchmarks.bench_small_trees e2e --weights q4 --datasets gsm8k --prompts 6 --max-tokens 64 --settings --repeats 3 --threads 2 --compile --out $D/e2e-$arm-$i.json) > $D/e2e-$arm-$i.log 2>&1
  done
done
top -bn1 | head -15 > $D/top-after.txt
echo done
