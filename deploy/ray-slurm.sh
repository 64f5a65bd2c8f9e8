#!/usr/bin/env bash
# Ray on a Slurm allocation for Sluice: the head on the allocation's first node, a worker on each
# other one, then the nightly flow (data stages and training) on that cluster. An example, not
# run by the tests; adapt the partition, resources and paths.
#
#   sbatch deploy/ray-slurm.sh
#
# Every node must see the repository's Python environment and the data root at the same paths
# (a shared file system): the node agents run that Python's torchrun, and checkpoints are written
# to the run directory under the data root.
#SBATCH --job-name=sluice-nightly
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PY="${PYTHON:-.venv/bin/python}"
RAY="$(dirname "$PY")/ray"
DATA_ROOT="${DATA_ROOT:-/shared/sluice-data}"
PORT="${RAY_PORT:-6379}"

# token authentication on every node: one token for this allocation, readable by this user only
export RAY_AUTH_MODE=token
umask 077
export RAY_AUTH_TOKEN_PATH="$DATA_ROOT/.ray-auth-token-$SLURM_JOB_ID"
"$PY" -c 'import secrets, sys; open(sys.argv[1], "w").write(secrets.token_hex(32))' "$RAY_AUTH_TOKEN_PATH"
trap 'rm -f "$RAY_AUTH_TOKEN_PATH"' EXIT

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')"

# the head: no CPUs of its own for tasks (it plans, merges and drives), no dashboard
srun --nodes=1 --ntasks=1 -w "$HEAD" --export=ALL \
    "$RAY" start --head --block --node-ip-address="$HEAD_IP" --port="$PORT" --num-cpus=0 \
    --include-dashboard=false &
sleep 15
# one Ray worker per other node, with that node's cores and GPUs
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" --export=ALL \
        "$RAY" start --block --address="$HEAD_IP:$PORT" \
        --num-cpus="$SLURM_CPUS_PER_TASK" --num-gpus="${SLURM_GPUS_PER_NODE:-0}" &
done
sleep 15

# the flow runs on the head node; Sluice joins the cluster with the token above
"$PY" -m sluice.flows.cli run nightly --data-root "$DATA_ROOT" \
    --set engine.name=ray --set "engine.address=$HEAD_IP:$PORT" --set launch.engine=ray

"$RAY" stop --force || true
