#!/usr/bin/env bash
# An elastic job: run this on every node (same RDZV_ENDPOINT and JOB_ID). The job starts once MIN_NODES have joined
# (MAX_NODES at most); when a node is lost, torchrun's agents on the others stop their workers and start them again
# on the nodes left (up to MAX_RESTARTS times), and train.py resumes from the last checkpoint on the new world size.
#
#   MIN_NODES=1 MAX_NODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 JOB_ID=run1 bash examples/elastic/torchrun.sh
#
# Variables:
#   RDZV_ENDPOINT   host:port of the rendezvous store; the node at that host hosts it (start it first).
#   JOB_ID          the same string on every node of the job.
#   MAX_RESTARTS    restarts per agent after a failure (a node joining or leaving does not count).
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
#                   set below: a fresh key-value store per round; with torchrun's default (one store shared by every
#                   round) the restarted ranks read the dead ranks' addresses and cannot connect.
set -euo pipefail

: "${MIN_NODES:=1}"
: "${MAX_NODES:=2}"
: "${NPROC_PER_NODE:=8}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT to host:port of the rendezvous (one of the nodes)}"
: "${JOB_ID:=lightning-mgpu-elastic}"
: "${MAX_RESTARTS:=3}"
: "${TORCHRUN:=torchrun}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$TORCHRUN" \
    --nnodes "$MIN_NODES:$MAX_NODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "$JOB_ID" \
    "$HERE/train.py" "$@"
