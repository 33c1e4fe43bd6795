#!/bin/bash
# phaserl on several nodes under Slurm: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch --nodes 4 examples/slurm_multinode.sh examples/grpo.yaml trainer.total_steps=500
#
# trainer.checkpoint_path and trainer.log_dir must be on storage every node mounts (phaserl checks
# this before training and names the hosts that do not share it). See docs/distributed.md.
#SBATCH --job-name=phaserl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1        # one torchrun per node; torchrun starts one rank per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch examples/slurm_multinode.sh CONFIG.yaml [key=value ...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}
RUN_DIR=${RUN_DIR:-/shared/phaserl/$SLURM_JOB_NAME-$SLURM_JOB_ID}   # on a shared filesystem

export OMP_NUM_THREADS=$((SLURM_CPUS_PER_TASK / GPUS_PER_NODE))
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a timed-out collective ends the process instead of hanging

# --kill-on-bad-exit: when one node's torchrun fails, Slurm stops the others.
srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \
  -m phaserl train "$CONFIG" \
  trainer.checkpoint_path="$RUN_DIR/checkpoints" trainer.log_dir="$RUN_DIR/logs" "$@"
