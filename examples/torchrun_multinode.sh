#!/usr/bin/env bash
# Launch the demo DLRM with the standard elastic launcher across NNODES machines, NPROC processes each.
# Run the same command on every node; RDZV_HOST is the address of the rendezvous host (any reachable
# machine; the job cannot outlive it, so prefer one that is not a training node).
#
#   NNODES=2 NPROC=4 RDZV_HOST=10.0.0.1 bash examples/torchrun_multinode.sh      # on each node
#   NNODES=1 NPROC=3 RDZV_HOST=127.0.0.1 bash examples/torchrun_multinode.sh     # one machine
#
# Elastic: the job runs on MIN_NODES..NNODES nodes. When a node dies, torchrun restarts the workers of the
# others; DLRoverStrategy decodes the lost node's embedding shards from the survivors' parity and resumes at
# the last committed step (onto the survivors, or onto a replacement node started with this same command).
# The CLI takes --trainer.devices/num_nodes from torchrun's worker group; the global batch size must be
# divisible by every world size the job may run at. PARITY_K: parity k with r=1; a lost node stays
# recoverable while k + 1 <= the number of nodes (2 nodes: k=1), and k + 1 <= ranks must always hold.
set -euo pipefail
NNODES=${NNODES:-1}
MIN_NODES=${MIN_NODES:-$NNODES}
NPROC=${NPROC:-2}
RDZV_HOST=${RDZV_HOST:-127.0.0.1}
RDZV_PORT=${RDZV_PORT:-29400}
CONFIG=${CONFIG:-configs/demo.yaml}
PARITY_K=${PARITY_K:-1}
RDZV_ID=${RDZV_ID:-lightning-dlrover-demo}   # a new id per job: survivors' spills are kept per id
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # restarted workers must not read the dead workers' addresses

exec torchrun \
  --nnodes="$MIN_NODES:$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$RDZV_ID" \
  --max-restarts=3 \
  -m lightning_dlrover fit --config "$CONFIG" \
  --data.global_batch_size=$((256 * NNODES * NPROC)) \
  --trainer.strategy.init_args.parity.k="$PARITY_K" --trainer.strategy.init_args.parity.r=1 \
  "$@"
