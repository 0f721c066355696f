#!/usr/bin/env bash
# gpt_1b (1.3B parameters) in bf16 on one GPU under DDP, FSDP (both world 1, trainer.compile=true) and ZeRO-3 with
# CPU offload, through the real `launch`; prints step time, tokens/s, MFU and peak memory per strategy. With two GPUs
# also tensor parallel: fsdp_tp (TP=2 x DP=1) against fsdp on 2.
# Goal on an H100/H200-class GPU: MFU >= 40% for DDP and FSDP. Under 8 minutes (each run is capped).
#
#   bash bench/gpu.sh [--dry-run] [out_dir]
#
# --dry-run starts nothing and needs no GPU: `launch plan` builds each configuration's model on the meta device
# (parameter count, per-rank memory, communication) and `launch --cfg job` checks that each composes.
set -euo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT=${1:-$(mktemp -d /tmp/gpu_bench.XXXX)}
BIN=$(dirname "$(command -v python)")
LAUNCH=${LAUNCH:-$BIN/launch}
cd "$(dirname "$0")/.."

# Sequence 1024, micro-batch 8, global 32: 4 micro-steps per optimizer step, 32k tokens per step.
JOB=(model=gpt_1b precision=bf16 gpus=1 data=synthetic data.seq_len=1024 data.vocab_size=50304
     batch.micro_size=8 batch.global_size=32 trainer.eval_every=0 trainer.warmup_steps=2 trainer.progress=false
     logger=none)
declare -A EXTRA=(  # per strategy: steps (the last logged window is the steady state), compile, time cap
  [ddp]="trainer.max_steps=20 trainer.log_every=10 trainer.compile=true"
  [fsdp]="trainer.max_steps=20 trainer.log_every=10 trainer.compile=true"
  [zero3_offload]="trainer.max_steps=6 trainer.log_every=3"  # DeepSpeed rejects trainer.compile; CPU Adam is slow
)
STRATEGIES=(ddp fsdp zero3_offload)

if (( DRY )); then
  for s in "${STRATEGIES[@]}"; do
    # shellcheck disable=SC2086
    "$LAUNCH" --cfg job strategy="$s" "${JOB[@]}" device=cuda ${EXTRA[$s]} > "$OUT/$s.yaml"
    echo "== $s: config composes ($OUT/$s.yaml); plan on the meta device:"
    "$LAUNCH" plan strategy="$s" "${JOB[@]}"
  done
  echo "== fsdp_tp (tensor parallel 2 x data parallel 1, two GPUs): plan on the meta device:"
  "$LAUNCH" plan strategy=fsdp_tp "${JOB[@]/gpus=1/gpus=2}"
  exit 0
fi

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in "${STRATEGIES[@]}"; do
  echo "== $s" >&2
  # shellcheck disable=SC2086
  timeout 170 "$LAUNCH" strategy="$s" "${JOB[@]}" device=cuda ${EXTRA[$s]} hydra.run.dir="$OUT/$s" \
    > "$OUT/$s.log" 2>&1 || echo "$s: exit $? (see $OUT/$s.log)" >&2
done
# Tensor parallel where two GPUs are lent: TP=2 x DP=1 against DP=2 (fsdp on 2), the same global batch; tp_comm_*
# in metrics.jsonl is the activations' traffic over NVLink (on one GPU the case is skipped, said so).
if (( $(nvidia-smi -L | wc -l) >= 2 )); then
  for s in fsdp fsdp_tp; do
    echo "== $s on 2 GPUs" >&2
    timeout 170 "$LAUNCH" strategy=$s "${JOB[@]/gpus=1/gpus=2}" device=cuda trainer.max_steps=20 trainer.log_every=10 \
      hydra.run.dir="$OUT/${s}_2gpu" > "$OUT/${s}_2gpu.log" 2>&1 || echo "${s}_2gpu: exit $? (see its log)" >&2
    STRATEGIES+=("${s}_2gpu")
  done
else
  echo "tensor parallel: one GPU here, the fsdp_tp case needs two (skipped)" >&2
fi
python - "$OUT" "${STRATEGIES[@]}" <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
print("| strategy | step time (s) | tokens/s | MFU | peak memory (GB) | model state on GPU (GB) |")
print("|---|---|---|---|---|---|")
for name in names:
    f = out / name / "metrics.jsonl"
    if not f.exists():
        print(f"| {name} | failed: see {out / (name + '.log')} | | | | |"); continue
    m = json.loads(f.read_text().splitlines()[-1])
    mfu = f"{100 * m['mfu']:.1f}%" if "mfu" in m else "— (unknown GPU: set trainer.peak_tflops)"
    print(f"| {name} | {m['step_time_s']:.3f} | {m['tokens_per_s']:.0f} | {mfu} | {m['peak_memory_bytes'] / 1e9:.1f} "
          f"| {m.get('model_state_bytes', 0) / 1e9:.1f} |")
PY

# A real out-of-memory error under batch.micro_size=auto: the plan is told the GPU holds 8x its memory, so the planner
# picks a micro-batch that cannot fit; each CUDA out-of-memory error restarts the worker group at half of it, and the
# run ends at exit 0 with the micro-batch that fits (its lines, then the micro-batches its steps ran at).
echo "== ddp, batch.micro_size=auto over an 8x overstated plan.device_memory_gb" >&2
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
timeout 240 "$LAUNCH" strategy=ddp "${JOB[@]/batch.micro_size=8/batch.micro_size=auto}" device=cuda \
  batch.global_size=64 trainer.max_steps=6 trainer.log_every=1 trainer.checkpoint_every=2 \
  plan.device_memory_gb=$(( MEM * 8 / 1000 )) hydra.run.dir="$OUT/oom" > "$OUT/oom.log" 2>&1; echo "exit $?"
grep -E "^auto: batch.micro_size|ran out of memory|^launch: micro-batch" "$OUT/oom.log" || true
python -c "import json,sys; print(sorted({(m['micro_size'], m['accumulation']) for m in map(json.loads, open(sys.argv[1]))}))" \
  "$OUT/oom/metrics.jsonl" || true
