#!/usr/bin/env bash
# Fit a 32B -> 8B cache map on a Cloud TPU pod slice: every host runs the same program (JAX multi-controller).
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a SHARED=/mnt/shared launch/templates/tpu_pod.sh
#
# Needs: the kvjax checkout at $REPO on every host with `pip install -e '.[tpu]'` done there (launch/venv installs
# the CPU test extra, not jax[tpu]), the HF checkpoints and the token .npy on a filesystem all hosts mount
# ($SHARED: Filestore/NFS; the map artifact and the orbax checkpoints are written there, so gs:// paths do not work).
# With --distributed on, jax.distributed.initialize() reads the coordinator, process count and id from the TPU
# metadata. If a host dies, the others exit within --heartbeat-timeout (+ a few s); rerun this script to resume
# from the last residual checkpoint (the ridge fit is recomputed, deterministically).
set -euo pipefail
TPU_NAME=${TPU_NAME:?set TPU_NAME (the pod slice)}
ZONE=${ZONE:?set ZONE}
SHARED=${SHARED:?set SHARED (a path every host mounts)}
REPO=${REPO:-\$HOME/kvjax}
SOURCE=${SOURCE:-$SHARED/models/Qwen3-32B}
TARGET=${TARGET:-$SHARED/models/Qwen3-8B}
TOKENS=${TOKENS:-$SHARED/data/calib_tokens.npy}
OUT=${OUT:-$SHARED/runs/qwen32_8}
# 'model' = chips per model replica (heads/FFN split; 64 query heads, 8 KV heads); 'data' = the remaining chips.
MESH_MODEL=${MESH_MODEL:-8}

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e; cd $REPO
  python -m launch.fit_distributed --distributed on --heartbeat-timeout 30 --step-timeout 1800 \
    --source $SOURCE --target $TARGET --tokens $TOKENS --out $OUT --dtype bfloat16 --mesh-model $MESH_MODEL \
    --calib-windows 4096 --heldout-windows 256 --window 2048 --batch-size 64 \
    --residual-steps 2000 --residual-batch 64 --prefix 1024 --cont 128 --lr 1e-3 --save-every 100 \
    2>&1 | tee -a $OUT.host\$(hostname).log
"
