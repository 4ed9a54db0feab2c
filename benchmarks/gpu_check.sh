#!/usr/bin/env bash
# The GPU path end to end, in under 8 minutes on one NVIDIA GPU (about 5 on an H200):
# ResNet-50 at 224 px on ImageNet-like synthetic JPEGs (500x375, ~60 KB each, read in place
# from local disk), trained under torchrun on 1 rank with DDP, then with FSDP (bf16 autocast,
# NCCL, pinned checkpoint staging: the trainer's CUDA defaults), a checkpoint every INTERVAL
# steps, one SIGKILL of the rank at KILL_STEP and the resume that torchrun restarts. Prints,
# per strategy: images/s (median of the log windows), the share of a step spent waiting
# for data (`data/fetch_seconds`), the checkpoint stall and save time, and goodput, then
# `python -m train.report`'s table.
#
#   benchmarks/gpu_check.sh [WORKDIR]      # WORKDIR keeps the dataset for a second run
#
# Without a GPU (or with DEVICE=cpu) it runs the same steps with tiny sizes in under a
# minute: tests/test_gpu_check.py runs it that way. Every size is an environment variable:
# MODEL IMAGE_SIZE WIDTH NUM_TRAIN NUM_VAL BATCH STEPS INTERVAL KILL_STEP (0: no kill)
# WORKERS STRATEGIES. torch.compile and GPU JPEG decode are not offered: the trainer has no
# key for either yet.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$work"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$work"  # MLflow is off, and Hydra's files go under $work/runs

DEVICE=${DEVICE:-$(python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
if [[ $DEVICE == cuda ]]; then
    cores=$(python -c 'import os; print(len(os.sched_getaffinity(0)))')
    : "${MODEL:=resnet50}" "${IMAGE_SIZE:=224}" "${WIDTH:=500}" "${NUM_TRAIN:=10000}"
    : "${NUM_VAL:=500}" "${BATCH:=256}" "${STEPS:=240}" "${INTERVAL:=40}" "${KILL_STEP:=130}"
    : "${WORKERS:=$(( cores > 4 ? (cores - 2 < 12 ? cores - 2 : 12) : 2 ))}"
else
    : "${MODEL:=tiny_cnn}" "${IMAGE_SIZE:=32}" "${WIDTH:=48}" "${NUM_TRAIN:=40}"
    : "${NUM_VAL:=10}" "${BATCH:=8}" "${STEPS:=8}" "${INTERVAL:=2}" "${KILL_STEP:=5}"
    : "${WORKERS:=1}"
fi
: "${STRATEGIES:=ddp fsdp}"
epochs=$(( (STEPS * BATCH + NUM_TRAIN - 1) / NUM_TRAIN ))  # the schedule spans the run

data=$work/data_${WIDTH}_${NUM_TRAIN}_${NUM_VAL}
python -m data.synthetic --out "$data" --num-train "$NUM_TRAIN" --num-val "$NUM_VAL" \
    --size "$WIDTH"
echo "device $DEVICE: $MODEL at ${IMAGE_SIZE}px, batch $BATCH, $STEPS steps, checkpoint" \
     "every $INTERVAL, SIGKILL at step $KILL_STEP, $WORKERS loader workers; in $work"

for strategy in $STRATEGIES; do
    run=$work/runs/$strategy
    rm -rf "$run"
    fault=""
    if (( KILL_STEP > 0 )); then fault="kill:rank=0:step=$KILL_STEP"; fi
    started=$(date +%s)
    # The kill ends attempt 0; torchrun's one restart resumes from the newest checkpoint.
    GOODPUT_FAULT=$fault python -m torch.distributed.run --standalone --nproc-per-node 1 \
        --max-restarts 1 -m train +experiment=resnet "model=$MODEL" "strategy=$strategy" \
        "data.root=$data" "data.image_size=$IMAGE_SIZE" "data.global_batch_size=$BATCH" \
        "data.val_batch_size=$BATCH" "data.num_workers=$WORKERS" \
        "trainer.max_steps=$STEPS" "trainer.max_epochs=$epochs" "trainer.log_every_steps=5" \
        "trainer.device=$DEVICE" "checkpoint.interval_steps=$INTERVAL" logger=none \
        "run.root=$work/runs" "run.name=$strategy" > "$work/$strategy.out" 2>&1 \
        || { tail -n 40 "$work/$strategy.out"; echo "gpu_check: $strategy failed"; exit 1; }
    python - "$run" "$strategy" "$BATCH" "$(( $(date +%s) - started ))" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

run, strategy, batch, wall = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
log = (run / "train.log").read_text()
rates = [float(r) for r in re.findall(r"train/images_per_second=([\d.]+)", log)]
parts = json.loads((run / "goodput.json").read_text())["seconds"]
events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
          if line.strip()]
stalls = [e["stall"] for e in events if e["kind"] == "save_staged" and e["rank"] == 0]
saves = [e["seconds"] for e in events if e["kind"] == "save_committed" and e["rank"] == 0]
# A process killed before its next step never learns that its last save committed: the
# resume from that step says so (as the goodput report counts them).
staged = {e["step"] for e in events if e["kind"] == "save_staged" and e["rank"] == 0}
landed = ({e["step"] for e in events if e["kind"] == "save_committed" and e["rank"] == 0}
          | ({e["step"] for e in events if e["kind"] == "resume"} & staged))
restarts = len({e["attempt"] for e in events if e["kind"] == "start"}) - 1
stepping = parts["compute"] + parts["data_wait"]
print(f"{strategy}: {statistics.median(rates[1:] or rates):.0f} images/s (median of "
      f"{len(rates)} log windows, batch {batch}); data/fetch_seconds "
      f"{100 * parts['data_wait'] / stepping:.1f}% of a step; checkpoint stall median "
      f"{statistics.median(stalls):.3f}s, save {statistics.median(saves):.2f}s "
      f"({len(landed)} saves); goodput {100 * parts['compute'] / sum(parts.values()):.1f}% "
      f"with {restarts} restart(s) in {wall}s")
EOF
    python -m train.report "$run" --out "$work/$strategy-goodput.png"
done
