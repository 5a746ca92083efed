#!/usr/bin/env bash
# dpax on one lent GPU, every check in one call (benchmarks/README.md, "On one
# GPU, 2026-11-27", has the results). Run from the repository root on the GPU
# machine with what its image lacks as Python 3.12 wheels in .whl/ (grain,
# array-record, portpicker, tensorboardX, nest-asyncio); JAX, Flax, Optax and
# Orbax are the image's. Writes logs to $OUT (or ./gpu-out).
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false DPAX_CACHE_DIR=/tmp/dpax-cache
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
# JAX, Flax, Optax and Orbax are the image's: pinned Flax 0.12.8 does not
# import with its JAX 0.11.2 (jax.experimental.hijax has no HiPrimitive).
python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'orbax', o.__version__, jax.devices())"

# In order of what a lease must see first, each step timed out so that the
# whole fits one call of at most ~9 minutes (a lease has 15, its start included).
for case in deep-mlp gpt2-small-bf16 gpt-4x128; do
  timeout 45 python3 scripts/gpu_check.py memory $case 2>&1 | grep -E "MEMORY|Error"
done | tee "$OUT/memory.log"

# The GPT's attention: cuDNN's fused kernel in the bf16 step, and its time against XLA's.
timeout 90 python3 scripts/gpu_check.py attention 2>&1 | grep -E "ATTENTION|Error" \
  | tee "$OUT/attention.log"

timeout 200 python3 -m dpax bench --workloads mlp,gpt,gpt-wide,cnn-avg --devices 1 --repeats 5 \
  --steps-per-call 1 --no-sweep --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"

for backend in shard_map pmap; do
  timeout 45 python3 scripts/gpu_check.py host $backend
done 2>&1 | tee "$OUT/host.log"

# XLA:GPU runs f32 matmuls in TF32 by default: compare at full precision
# (at the default the GPT differed by 1e-2, TF32's rounding through Adam).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 python3 scripts/gpu_check.py equivalence \
  2>&1 | tee "$OUT/equivalence-highest.log"

timeout 20 python3 -m dpax estimate --model gpt --data text --layers 12 --width 768 --heads 12 \
  --seq-len 1024 --batch-size 8 --devices 1 --precision bf16 --device-tflops 989 \
  --device-memory-gb 80 2>&1 | tee "$OUT/estimate.log"

timeout 80 python3 -m dpax train --model gpt --data text --layers 6 --width 512 --heads 8 \
  --seq-len 256 --batch-size 32 --steps 200 --precision bf16 --devices 1 --out /tmp/gpt \
  --overwrite --verbose 2>&1 | grep -vE "^  |^[a-z_]+:$" | tee "$OUT/gpt.log"
cp /tmp/gpt/metrics.jsonl /tmp/gpt/run.json "$OUT/" 2>/dev/null
python3 - <<'EOF'
import json, numpy as np
rows = [json.loads(l) for l in open("/tmp/gpt/metrics.jsonl") if '"mfu"' in l]
m = np.array([r["mfu"] for r in rows][1:])  # the first interval holds the compile
print("MFU percentiles (p10, p50, p90, max):", np.percentile(m, [10, 50, 90, 100]).round(4))
print(json.load(open("/tmp/gpt/run.json")).get("mfu_peak_source"))
EOF
