#!/usr/bin/env bash
# dpax on one lent GPU, its checks in one call (benchmarks/README.md has the
# results of each lease). Run from the repository root on the GPU machine with
# what its image lacks as Python 3.12 wheels in .whl/ (grain, array-record,
# portpicker, tensorboardX, nest-asyncio); JAX, Flax, Optax and Orbax are the
# image's. Writes logs to $OUT (or ./gpu-out).
#
#   bash scripts/gpu_check.sh                  # every check, in the order below
#   bash scripts/gpu_check.sh mfu train        # some of them
#
# In order of what a lease must see first, each under its own time limit. All
# of them take longer than one call (at most 10 minutes; a lease has 15, its
# starts included): name the ones a call has time for.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false DPAX_CACHE_DIR=/tmp/dpax-cache
CHECKS=${*:-mfu train estimate attention equivalence turns memory bench host}
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
# JAX, Flax, Optax and Orbax are the image's: pinned Flax 0.12.8 does not
# import with its JAX 0.11.2 (jax.experimental.hijax has no HiPrimitive).
python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
      'orbax', o.__version__, jax.devices())"

# GPT-2 small's shape (12 x 768, 1024 tokens) on byte tokens.
GPT2_SMALL="--model gpt --layers 12 --width 768 --heads 12 --seq-len 1024"

for check in $CHECKS; do
  echo "=== $check ($(date +%T))"
  case $check in
  mfu)  # MFU per precision policy, attention and batch size, and where the time goes
    timeout 240 python3 scripts/gpu_mfu.py 2>&1 | tee "$OUT/mfu.log" ;;
  turns)  # dpax against the hand loop, timed in turns (paired ratios)
    timeout 130 python3 scripts/gpu_mfu.py --turns --repeats 7 \
      --only hand-bf16-b32,dpax-bf16-b32,hand-bf16-b8,dpax-bf16-b8 2>&1 | tee "$OUT/turns.log" ;;
  train)  # the same shape as a user runs it: bf16, the platform's attention, grad-accum
    timeout 90 python3 -m dpax train $GPT2_SMALL --data text --batch-size 64 --grad-accum 2 \
      --steps 40 --log-every 10 --precision bf16 --devices 1 --out /tmp/gpt --overwrite \
      --verbose 2>&1 | grep -vE "^  |^[a-z_]+:$" | tee "$OUT/gpt.log"
    cp /tmp/gpt/metrics.jsonl /tmp/gpt/run.json "$OUT/" 2>/dev/null
    python3 - <<'EOF'
import json, numpy as np
rows = [json.loads(l) for l in open("/tmp/gpt/metrics.jsonl") if '"mfu"' in l]
m = np.array([r["mfu"] for r in rows][1:])  # the first interval holds the compile
print("MFU after the first interval (min, median, max):", m.min().round(4),
      np.median(m).round(4), m.max().round(4))
print("tokens/s (median):", np.median([r["tokens_per_sec"] for r in rows][1:]).round(0))
print(json.load(open("/tmp/gpt/run.json")).get("mfu_peak_source"))
EOF
    ;;
  estimate)  # the predicted step of the `train` check's shape on this card
    timeout 25 python3 -m dpax estimate $GPT2_SMALL --data text --batch-size 64 --grad-accum 2 \
      --devices 1 --precision bf16 --device-tflops 989 --device-memory-gb 141 2>&1 \
      | tee "$OUT/estimate.log" ;;
  attention)  # cuDNN's fused kernel in the bf16 step, and its time against XLA's
    timeout 90 python3 scripts/gpu_check.py attention 2>&1 | grep -E "ATTENTION|Error" \
      | tee "$OUT/attention.log" ;;
  equivalence)  # f32 matmuls at full precision (XLA:GPU's default is TF32)
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout 60 python3 scripts/gpu_check.py equivalence \
      2>&1 | tee "$OUT/equivalence-highest.log" ;;
  memory)
    for case in deep-mlp gpt2-small-bf16 gpt-4x128; do
      timeout 45 python3 scripts/gpu_check.py memory $case 2>&1 | grep -E "MEMORY|Error"
    done | tee "$OUT/memory.log" ;;
  bench)
    timeout 200 python3 -m dpax bench --workloads ${BENCH_WORKLOADS:-mlp,gpt,gpt-wide,cnn-avg} --devices 1 \
      --repeats 5 --steps-per-call 1 --no-sweep --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" ;;
  host)
    for backend in shard_map pmap; do
      timeout 45 python3 scripts/gpu_check.py host $backend
    done 2>&1 | tee "$OUT/host.log" ;;
  *) echo "unknown check $check" ;;
  esac
done
echo "=== done ($(date +%T))"
