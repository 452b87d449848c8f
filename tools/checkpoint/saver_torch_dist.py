"""``--saver torch_dist``: Megatron-LM's ``--ckpt-format torch_dist`` checkpoint. Its tensors are stored at their
full shapes (Megatron-LM reads them at any TP/PP), written as a TP=1, PP=1 run's; with ``--reshard-optimizer``
the optimizer is that run's distributed optimizer (``dp_reshardable``)."""

from megatron.core.checkpoint_formats import CheckpointFormatError
from megatron.core.checkpoint_formats.megatron_dist import write_torch_dist_checkpoint
from megatron.core.checkpoint_formats.megatron_lm import megatron_args, megatron_param_groups
from saver_common import shards_and_state


def save(opts, payload) -> list:
    if (opts.target_tensor_parallel_size or 1, opts.target_pipeline_parallel_size or 1) != (1, 1):
        raise CheckpointFormatError("--saver torch_dist stores full tensors, which Megatron-LM reads at any TP/PP: "
                                    "leave out --target-tensor-parallel-size/--target-pipeline-parallel-size")
    opts.target_tensor_parallel_size = opts.target_pipeline_parallel_size = 1
    shards, optimizer, scheduler, rng, _, notes = shards_and_state(opts, payload)
    payload.notes.extend(notes)
    by_name = None
    if optimizer:
        named, meta = optimizer[(0, 0)]
        by_name = (named, dict(meta, param_groups=megatron_param_groups(meta["param_groups"], scheduler)))
    ns = megatron_args(payload.args, payload.dims, 1, 1, payload.consumed_samples, payload.iteration,
                       distributed_optimizer=by_name is not None, ckpt_format="torch_dist")
    iter_dir = write_torch_dist_checkpoint(opts.save_dir, shards[(0, 0)][0], payload.dims, ns, payload.iteration,
                                           payload.family, optimizer_by_name=by_name, scheduler=scheduler,
                                           rng=(rng or {}).get((0, 0)))
    return [iter_dir]
