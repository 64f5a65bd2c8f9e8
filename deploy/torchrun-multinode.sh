#!/usr/bin/env bash
# Train across machines with the same worker entry point Sluice uses on one machine.
# Run this on every node, with the same JOB file visible at the same path, e.g. on shared
# storage: a TrainJob (sluice.stages.train.job) as JSON, written by sluice.stages.train.launch or
# by hand; checkpoints, metrics and the result go beside it.
#
#   NNODES=2 NODE_RANK=0 RDZV=node0.example:29400 NPROC=8 deploy/torchrun-multinode.sh job.json   # on node 0
#   NNODES=2 NODE_RANK=1 RDZV=node0.example:29400 NPROC=8 deploy/torchrun-multinode.sh job.json   # on node 1
#
# torchrun's c10d rendezvous is hosted by node 0 at RDZV; the other nodes fail within
# RDZV_TIMEOUT seconds if they cannot reach it. MAX_RESTARTS lets the job survive a killed rank
# (it resumes from the last checkpoint in the job's checkpoint directory).
set -euo pipefail
JOB="${1:?usage: $0 job.json}"
: "${NNODES:=1}" "${NODE_RANK:=0}" "${NPROC:=2}" "${RDZV:=127.0.0.1:29400}" "${RDZV_TIMEOUT:=120}" "${MAX_RESTARTS:=3}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "sluice-${RDZV//[:.]/-}" \
  --rdzv-conf "join_timeout=${RDZV_TIMEOUT},read_timeout=${RDZV_TIMEOUT}" \
  --max-restarts "$MAX_RESTARTS" \
  -m sluice.stages.train.worker --job "$JOB"
