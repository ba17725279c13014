#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one pass (about 6 minutes on one H200):
#   1. `tunelab env`: what torch sees, and where tunelab computes (compute_device)
#   2. the tests marked gpu: bf16/fp16 training steps, the update check's on-device
#      fingerprints, the sizing's peak within 10 % of max_memory_allocated, every packed
#      attention route and the fused loss against the padded computation, precision auto
#   3. sizing against measured bf16 steps on SmolLM2-135M's and Llama-3.2-1B's shapes (random
#      weights, no download): predicted peak vs max_memory_allocated, step time, tokens/s
#   4. the GPU plan's projected step against those fresh steps (benchmarks/gpu_projection.py)
#   4b. QLoRA: a measured bf16 step over a 4-bit (NF4) SmolLM2-shaped base beside LoRA's, its
#      max_memory_allocated against the prediction; the QLoRA training tests on the GPU
#   5. the classification demo end to end on the GPU, then `tunelab plan --review`, and a plan
#      projected onto this GPU from the catalog reviewed against the demo's GPU runs
#   5b. evaluation by generation on the GPU: the extraction demo's study (trained once here) by
#      tunelab (merged copy; packing is CPU-only) against `generate` on the unmerged peft model,
#      outputs required identical (benchmarks/generation.py, about 3 minutes)
#   6. training throughput on Llama-3.2-1B's shape in bf16 against Trainer + peft (with and
#      without Liger), TRL packing and padding_free, with each side's model-FLOP utilization
#      (benchmarks/throughput.py --device cuda, about 5 minutes more)
#
#   bash benchmarks/cuda_check.sh OUTDIR [DEMO_DIR]
#   CUDA_CHECK_ONLY="env gpu-tests throughput-cuda" bash benchmarks/cuda_check.sh OUTDIR
# Every step writes under OUTDIR; a failed step is reported and the next one still runs.
# CUDA_CHECK_ONLY names the steps to run (all when unset).
set -u
out=${1:?usage: cuda_check.sh OUTDIR [DEMO_DIR]}
demo=${2:-/tmp/tunelab-cuda-demo}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
only=${CUDA_CHECK_ONLY:-}
step() {  # step NAME TIMEOUT_S COMMAND...: timed, logged, never stops the script
    local name=$1 limit=$2
    shift 2
    if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return 0; fi
    local t0=$SECONDS
    echo "=== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step env 40 $py -m tunelab env --json
step gpu-tests 240 $py -m pytest -q -p no:cacheprovider -m gpu \
    tests/stages/sizing/test_sizing.py tests/stages/train/test_train_loop.py tests/lib/test_models.py \
    tests/stages/train/test_throughput.py tests/stages/train/test_compute.py
step sizing-bf16 190 $py benchmarks/sizing_accuracy.py --device cuda --precision bf16 \
    --models smollm2-shape,llama1b-shape --lengths 2048 --micro-batch 8 --threads 8 \
    --json-out "$out/sizing-bf16.json"
step qlora 150 $py benchmarks/sizing_accuracy.py --device cuda --precision bf16 \
    --models smollm2-shape --methods qlora,lora --checkpointing off,on --lengths 2048 \
    --micro-batch 8 --threads 8 --json-out "$out/qlora.json"
step qlora-tests 90 $py -m pytest -q -p no:cacheprovider tests/lib/test_qlora.py \
    -k "records_the_4bit_base or losses_fall or changed_4bit_weight"
# the catalog id of this GPU (H200 when the name is not in the catalog)
gpu_id=$($py -c "import torch; from tunelab.stages.plan.catalog import gpu_of_device as g; \
d = g(torch.cuda.get_device_name(0)); print(d.id if d else 'H200')" 2>/dev/null || echo H200)
step gpu-projection 60 $py benchmarks/gpu_projection.py --rows "$out/sizing-bf16.json" \
    --gpu "$gpu_id" --micro-batch 8
rm -rf "$demo"
step demo 190 $py -m tunelab demo --dir "$demo"
step plan-review 40 $py -m tunelab plan --review --study "$demo" --json
step plan-gpu 40 $py -m tunelab plan --study "$demo" --gpu "$gpu_id" --json
step plan-gpu-review 40 $py -m tunelab plan --review --study "$demo" --json
step compare-gpus 40 $py -m tunelab plan --study "$demo" --compare-gpus
cp "$demo/report/dossier.md" "$out/" 2>/dev/null || true
TUNELAB_CACHE="$demo-bench" step generation-cuda 300 $py benchmarks/generation.py --repeats 2
step throughput-cuda 420 $py benchmarks/throughput.py --device cuda --json
