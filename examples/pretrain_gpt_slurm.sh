#!/usr/bin/env bash
#SBATCH --job-name=gpt-pretrain
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# SLURM wrapper: one torchrun per node, node 0 is the rendezvous host.
# Usage: DATA=... VOCAB=... MERGES=... sbatch examples/pretrain_gpt_slurm.sh
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NNODES=$SLURM_NNODES
srun --export=ALL bash -c 'NODE_RANK=$SLURM_NODEID bash examples/pretrain_gpt_multinode.sh'
