#!/usr/bin/env bash
# Start this node's share of a multi-node HybridStrategy job with torchrun. Run it once on every node, each with its
# own NODE_RANK (0 .. NNODES-1) and the same MASTER_ADDR/MASTER_PORT; extra arguments go to train.py.
#
#   node 0:  NNODES=2 NPROC_PER_NODE=8 NODE_RANK=0 MASTER_ADDR=node0 bash examples/multinode/torchrun.sh --tp 8 --pp 2
#   node 1:  NNODES=2 NPROC_PER_NODE=8 NODE_RANK=1 MASTER_ADDR=node0 bash examples/multinode/torchrun.sh --tp 8 --pp 2
#
# Ranks are node-major (node n holds ranks n*NPROC_PER_NODE ...) and tensor parallelism is the innermost mesh
# axis, so --tp dividing NPROC_PER_NODE keeps each tp group (collectives in every layer) inside one node, and
# --pp puts the pipeline stages (one point-to-point send per microbatch) across nodes.
#
# Variables that matter:
#   MASTER_ADDR   address of node 0, reachable from every node (a hostname or the IP of the fast interface).
#   MASTER_PORT   a free TCP port on node 0 (default 29500); torchrun's rendezvous and torch.distributed's store.
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
#                 the network interface for NCCL's (GPU) and gloo's (CPU) bootstrap/traffic, e.g. "ib0" or
#                 "eth0" ("^lo,docker" excludes). Set them when nodes have several interfaces and the wrong one
#                 is picked (symptom: the job hangs at start-up or in its first collective).
#   NCCL_DEBUG=INFO  prints the transport NCCL chose (NET/IB or NET/Socket): check it is the one you expect.
#   NCCL_IB_HCA / NCCL_IB_DISABLE=1
#                 which InfiniBand adapters NCCL uses / none (then it falls back to sockets).
#   OMP_NUM_THREADS
#                 torchrun sets 1 per process when it is unset (and says so); on CPU give each process its share
#                 of the node's cores, e.g. cores / NPROC_PER_NODE.
#   TORCHRUN      the torchrun executable (default: torchrun from PATH, e.g. .venv/bin/torchrun).
set -euo pipefail

: "${NNODES:=2}"
: "${NPROC_PER_NODE:=8}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 .. NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${MASTER_PORT:=29500}"
: "${TORCHRUN:=torchrun}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# --max-restarts 0: a failed rank ends the job on every node (a restart would rerun the script from step 0;
# resume from a checkpoint with ckpt_path instead).
exec "$TORCHRUN" \
    --nnodes "$NNODES" \
    --nproc_per_node "$NPROC_PER_NODE" \
    --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" \
    --max-restarts 0 \
    "$HERE/train.py" --nodes "$NNODES" --devices "$NPROC_PER_NODE" "$@"
