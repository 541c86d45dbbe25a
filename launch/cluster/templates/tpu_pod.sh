#!/usr/bin/env bash
# The main job (python -m kvjax.launch --config=qwen32_8: fit the 32B -> 8B cache map, evaluate, report) on a Cloud
# TPU pod slice: every host runs the same program (JAX multi-controller).
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a SHARED=/mnt/shared launch/cluster/templates/tpu_pod.sh
#
# Needs: the kvjax checkout at $REPO on every host with `pip install -e '.[tpu]'` done there (launch/venv installs
# the CPU test extra, not jax[tpu]), the HF checkpoints and the calibration text on a filesystem all hosts mount
# ($SHARED: Filestore/NFS; the run directory is written there: the residual's orbax checkpoints by every host, the
# maps, stage markers and report by process 0, so gs:// paths do not work). With --distributed=on,
# jax.distributed.initialize() reads the coordinator, process count and id from the TPU metadata. The map fit and
# the residual training use every chip of every host (one data-parallel row per host, the model split over
# MESH_MODEL chips of a host); then process 0 evaluates on its host's chips while the others wait. If a host dies,
# the others exit within --heartbeat_timeout (+ a few s); rerun this script to reuse the finished stages and resume
# the residual from its last checkpoint.
set -euo pipefail
TPU_NAME=${TPU_NAME:?set TPU_NAME (the pod slice)}
ZONE=${ZONE:?set ZONE}
SHARED=${SHARED:?set SHARED (a path every host mounts)}
REPO=${REPO:-\$HOME/kvjax}
SOURCE=${SOURCE:-$SHARED/models/Qwen3-32B}
TARGET=${TARGET:-$SHARED/models/Qwen3-8B}
TRAIN_TEXT=${TRAIN_TEXT:-stdlib:train}  # .jsonl / .txt / .npy token array (see kvjax.run.config.DataConfig)
OUT=${OUT:-$SHARED/runs/qwen32_8}
# 'model' = chips per model replica, within one host (heads/FFN split; 64 query heads, 8 KV heads)
MESH_MODEL=${MESH_MODEL:-4}

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e; cd $REPO
  python -m kvjax.launch --config=qwen32_8 --distributed=on --heartbeat_timeout=30 --step_timeout=1800 \
    --config.source.path=$SOURCE --config.target.path=$TARGET --config.output_dir=$OUT \
    --config.data.train_text=$TRAIN_TEXT --config.mesh.model=$MESH_MODEL \
    --config.map.calib_windows=4096 --config.map.batch_size=64 \
    --config.residual.steps=2000 --config.residual.batch_size=64 --config.residual.save_every=100 \
    2>&1 | tee -a $OUT.host\$(hostname).log
"
