#!/usr/bin/env bash
# The checks and figures that need a real GPU (recorded in docs/profile.md and docs/train.md).
#   bench/gpu.sh OUT [tests] [profile] [train] [probe]
# tests:   the suite's CUDA tests (skipped everywhere else)
# profile: `poplar profile` of llama-125m (seq 256) on this GPU, every ZeRO stage, with its plot
# train:   `poplar train` of llama-350m (seq 1024, bf16) on this GPU: profile, plan, train; tokens/s and MFU
# probe:   plain PyTorch forward+backward of the same model, for scale (no Poplar)
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT [tests] [profile] [train] [probe]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 COLUMNS=160 POPLAR_CACHE_DIR="$out/cache" POPLAR_DATA_CACHE="$out/data"
SECTIONS=" ${*:-all} "
want() { [[ "$SECTIONS" == *" all "* || "$SECTIONS" == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/machine.txt"

if want tests; then
  timeout 300 python -m pytest -q -p no:cacheprovider tests/devices/test_cuda.py tests/profile/test_discover.py \
    tests/profile/test_real_profiler.py tests/train/test_real_devices.py 2>&1 | tee "$out/tests.txt"
fi
if want probe; then
  timeout 120 python - <<'EOF' 2>&1 | tee "$out/probe.txt"
import time, torch
from poplar.workload import Workload
wl = Workload(model="llama-350m", seq_len=1024, vocab_size=8192)
model = wl.build().cuda().to(torch.bfloat16)
for mbs in (8, 16, 32):
    batch = tuple(t.cuda() for t in wl.random_batch(mbs))
    for i in range(4):
        if i == 1:
            torch.cuda.synchronize(); t0 = time.perf_counter()
        wl.loss(model, batch).backward()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / 3
    print(f"plain bf16 fwd+bwd, micro-batch {mbs}: {dt * 1000:.1f} ms, {mbs * 1024 / dt:,.0f} tokens/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
EOF
fi
if want profile; then
  timeout 400 python -m poplar.cli.main profile --model llama-125m --seq-len 256 --cluster none --points 4 --repeats 3 \
    --max-micro-batch 1024 --out "$out/profile-llama-125m.json" --plot "$out/profile-llama-125m.png" 2>&1 | tee "$out/profile.txt"
fi
if want train; then
  timeout 500 python -m poplar.cli.main train --cluster none --model llama-350m --global-batch 64 --steps 30 \
    --set seq_len=1024 --set vocab_size=8192 --set mixed_precision=bf16 --set lr=3e-4 --set warmup_steps=5 \
    --out "$out/train-llama-350m" 2>&1 | tee "$out/train.txt"
  cp "$out/train-llama-350m/log.jsonl" "$out/train-llama-350m.jsonl" 2>/dev/null
  cp "$out/train-llama-350m/plan.json" "$out/train-llama-350m-plan.json" 2>/dev/null
fi
