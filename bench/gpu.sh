#!/usr/bin/env bash
# The checks and figures that need a real GPU (recorded in docs/devices.md).
#   bench/gpu.sh OUT [declared] [engine] [tests] [profile] [train] [fp16] [yourmodel]
# declared: the device model (poplar.emulate.model) against real bf16 forward+backward times (bench/gpu_model.py)
# engine:   llama-1b through poplar.initialize against a plain PyTorch loop: step-time ratio and MFU
# tests:    the suite's CUDA tests (skipped everywhere else)
# profile:  `poplar profile --cluster none` of llama-125m (seq 1024, bf16) on this GPU, with its plot
# train:    `poplar train --cluster none` of llama-350m (seq 1024, bf16) on this GPU: profile, plan, train
# fp16:     the engine's fp16 (dynamic loss scale): its CUDA test against GradScaler, llama-1b against PyTorch's
#           autocast + GradScaler loop, and `poplar train` of llama-350m in fp16 (the train section's run, in fp16)
# yourmodel: a user's checkpoint on this GPU: examples/your_model.py's Qwen2 at YM_HIDDEN x YM_LAYERS (1024 x 16),
#           `poplar train --cluster none --model DIR --data DIR.jsonl --export` in bf16, then from_pretrained on CUDA
# Packages the GPU image lacks travel as wheels in .whl/ (bench/README.md says which); each section writes under OUT
# as it finishes (all output in OUT/log.txt).
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT [declared] [engine] [tests] [profile] [train] [fp16] [yourmodel]}
shift
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
work=$(mktemp -d)   # caches and run directories: only the figures come back under OUT (a few files)
export PYTHONUNBUFFERED=1 COLUMNS=160 POPLAR_CACHE_DIR="$work/cache" POPLAR_DATA_CACHE="$work/data"
SECTIONS=" ${*:-all} "
want() { [[ "$SECTIONS" == *" all "* || "$SECTIONS" == *" $1 "* ]]; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$out/log.txt"

if want declared; then
  timeout 130 python3 bench/gpu_model.py declared --out "$out" 2>&1 | tee -a "$out/log.txt"
fi
if want engine; then
  timeout 110 python3 bench/gpu_model.py engine --out "$out" 2>&1 | tee -a "$out/log.txt"
fi
if want tests; then
  timeout 130 python3 -m pytest -q -p no:cacheprovider tests/devices/test_cuda.py tests/profile/test_discover.py \
    tests/profile/test_real_profiler.py tests/train/test_real_devices.py 2>&1 | tee -a "$out/log.txt"
fi
if want profile; then
  timeout 110 python3 -m poplar.cli.main profile --model llama-125m --seq-len 1024 --cluster none --stages 0,3 \
    --points 4 --repeats 2 --max-micro-batch 512 --mixed-precision bf16 --out "$out/profile-llama-125m.json" \
    --plot "$out/profile-llama-125m.png" 2>&1 | tee -a "$out/log.txt"
fi
train_350m() {   # precision, suffix
  timeout 110 python3 -m poplar.cli.main train --cluster none --model llama-350m --global-batch 32 --steps 15 \
    --set seq_len=1024 --set vocab_size=8192 --set mixed_precision="$1" --set lr=3e-4 --set warmup_steps=5 \
    --set "stages=[0]" --out "$work/train-llama-350m$2" 2>&1 | tee -a "$out/log.txt"
  cp "$work/train-llama-350m$2/log.jsonl" "$out/train-llama-350m$2.jsonl" 2>/dev/null
  cp "$work/train-llama-350m$2/plan.json" "$out/train-llama-350m$2-plan.json" 2>/dev/null
}
if want train; then
  train_350m bf16 ""
fi
if want fp16; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_fp16_cuda.py tests/engine/test_loss_scale.py \
    tests/integrations/test_lightning_cuda.py \
    2>&1 | tee -a "$out/log.txt"
  timeout 110 python3 bench/gpu_model.py engine --precision fp16 --out "$out" 2>&1 | tee -a "$out/log.txt"
  train_350m fp16 -fp16
fi
your_model() {   # a user's Qwen2 directory and JSONL: profile, plan, train from its weights, export, load back
  local dir="$work/my-qwen" tuned="$work/my-qwen-tuned"
  python3 examples/your_model.py --out "$dir" --hidden "${YM_HIDDEN:-1024}" --layers "${YM_LAYERS:-16}" \
    --vocab 8192 2>&1 | tee -a "$out/log.txt"
  timeout 200 python3 -m poplar.cli.main train --cluster none --model "$dir" --data "$dir.jsonl" --global-batch 64 \
    --steps 15 --set seq_len=128 --set mixed_precision="${YM_PRECISION:-bf16}" --set lr=1e-4 --set warmup_steps=3 \
    --export "$tuned" --out "$work/train-my-qwen" 2>&1 | tee -a "$out/log.txt"
  cp "$work/train-my-qwen/log.jsonl" "$out/train-my-qwen.jsonl" 2>/dev/null
  cp "$work/train-my-qwen/plan.json" "$out/train-my-qwen-plan.json" 2>/dev/null
  timeout 60 python3 - "$tuned" "$dir" <<'PY' 2>&1 | tee -a "$out/log.txt"
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tuned, base = sys.argv[1], sys.argv[2]
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(tuned).to(device)
start = AutoModelForCausalLM.from_pretrained(base)
moved = sum(int(not torch.equal(a, b.to(a.dtype))) for a, b in zip(model.cpu().state_dict().values(), start.state_dict().values()))
model.to(device)
tok = AutoTokenizer.from_pretrained(base)
ids = tok("A class definition", return_tensors="pt").input_ids.to(device)
text = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0])
print(f"exported: {sum(p.numel() for p in model.parameters()):,} parameters loaded on {device}, "
      f"{moved} of {len(start.state_dict())} tensors moved from the checkpoint; generated: {text!r}")
PY
}
if want yourmodel; then
  your_model
fi
