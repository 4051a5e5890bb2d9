#!/usr/bin/env bash
# Launch the demo DLRM with the standard elastic launcher across NNODES machines, NPROC processes each.
# Run the same command on every node; RDZV_HOST is the address of any one of them (the rendezvous host).
#
#   NNODES=2 NPROC=4 RDZV_HOST=10.0.0.1 bash examples/torchrun_multinode.sh      # on each node
#   NNODES=1 NPROC=2 RDZV_HOST=127.0.0.1 bash examples/torchrun_multinode.sh     # one machine
#
# Lightning detects torchrun's environment (TorchElasticEnvironment); --trainer.devices and
# --trainer.num_nodes must match NPROC and NNODES.
set -euo pipefail
NNODES=${NNODES:-1}
NPROC=${NPROC:-2}
RDZV_HOST=${RDZV_HOST:-127.0.0.1}
RDZV_PORT=${RDZV_PORT:-29400}
CONFIG=${CONFIG:-configs/demo.yaml}

exec torchrun \
  --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id=lightning-dlrover-demo \
  --max-restarts=3 \
  -m lightning_dlrover fit --config "$CONFIG" \
  --trainer.devices="$NPROC" --trainer.num_nodes="$NNODES" --data.global_batch_size=$((256 * NNODES * NPROC)) \
  "$@"
