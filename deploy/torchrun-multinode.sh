#!/usr/bin/env bash
# Train across machines with the same worker entry point Sluice uses on one machine.
# Run this on every node, with the same JOB file visible at the same path, e.g. on shared
# storage: a TrainJob (sluice.stages.train.job) as JSON, written by sluice.stages.run.launch or
# by hand; checkpoints, metrics and the result go beside it.
#
#   NNODES=2 NODE_RANK=0 RDZV=10.0.0.1:29400 LOCAL_ADDR=10.0.0.1 NPROC=8 deploy/torchrun-multinode.sh job.json   # node 0
#   NNODES=2 NODE_RANK=1 RDZV=10.0.0.1:29400 LOCAL_ADDR=10.0.0.2 NPROC=8 deploy/torchrun-multinode.sh job.json   # node 1
#
# torchrun's c10d rendezvous is hosted by node 0 (NODE_RANK=0) at RDZV; the other nodes fail
# within RDZV_TIMEOUT seconds if they cannot reach it, and node 0 gives up after RDZV_TIMEOUT
# seconds if a node never joins. Global ranks are assigned by the rendezvous, not by NODE_RANK.
# LOCAL_ADDR is the address this node's ranks advertise (default: its host name); IFACE, the
# NIC gloo/NCCL use (GLOO_SOCKET_IFNAME). MAX_RESTARTS lets the job survive a killed rank: every
# node restarts its workers, which resume from the last checkpoint in the job's directory.
#
# Ports: node 0 listens on RDZV's port (rendezvous) and, per attempt, rank 0 on one free port
# (the workers' store); gloo listens on IFACE on every node. Allow them between the nodes only.
# The same as `sluice.stages.run.nodes.launch_nodes`, which the flows use (launch.nodes).
set -euo pipefail
JOB="${1:?usage: $0 job.json}"
: "${NNODES:=1}" "${NODE_RANK:=0}" "${NPROC:=2}" "${RDZV:=127.0.0.1:29400}" "${RDZV_TIMEOUT:=120}" "${MAX_RESTARTS:=3}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
IS_HOST=0; [ "$NODE_RANK" = 0 ] && IS_HOST=1
LOCAL=(); [ -n "${LOCAL_ADDR:-}" ] && LOCAL=(--local-addr "$LOCAL_ADDR")
if [ -n "${IFACE:-}" ]; then export GLOO_SOCKET_IFNAME="$IFACE" NCCL_SOCKET_IFNAME="$IFACE"; fi
# a fresh workers' store per attempt: after a restart nodes may disagree on the restart count
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONUNBUFFERED=1
exec "$PY" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" "${LOCAL[@]}" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "sluice-${RDZV//[:.]/-}" \
  --rdzv-conf "is_host=${IS_HOST},join_timeout=${RDZV_TIMEOUT},read_timeout=${RDZV_TIMEOUT}" \
  --max-restarts "$MAX_RESTARTS" \
  -m sluice.stages.train.rank --job "$JOB"
