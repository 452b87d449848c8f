#!/usr/bin/env bash
#SBATCH --job-name=gpt-pretrain
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --signal=USR1@120
# SLURM wrapper: one torchrun per node, node 0 is the rendezvous host.
# Usage: DATA=... VOCAB=... MERGES=... sbatch examples/pretrain_gpt_slurm.sh
#
# Preemption and the time limit: 120 s before the limit SLURM sends SIGUSR1 to every process of the job step
# (--signal=USR1@120). With --exit-signal-handler --exit-signal SIGUSR1 the training processes finish their
# iteration, save a checkpoint on every rank and exit 0 (one rank receiving it is enough: the ranks decide
# together). torchrun itself would die of SIGUSR1 (its default action), so the step ignores it before starting
# torchrun; the training processes install their own handler. Choose the 120 s to exceed one iteration plus one
# checkpoint save. Resubmitting the same script resumes from the folder (--load), see docs/reliability.md.
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export NNODES=$SLURM_NNODES
srun --export=ALL bash -c 'trap "" USR1; NODE_RANK=$SLURM_NODEID exec bash examples/pretrain_gpt_multinode.sh \
    --exit-signal-handler --exit-signal SIGUSR1'
