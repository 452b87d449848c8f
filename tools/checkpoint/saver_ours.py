"""``--saver ours``: our checkpoint folder at the target TP/PP (model; optimizer with ``--reshard-optimizer``)."""

from megatron.core.checkpoint_formats import write_our_checkpoint
from saver_common import shards_and_state


def save(opts, payload) -> list:
    shards, optimizer, scheduler, rng, release, notes = shards_and_state(opts, payload)
    payload.notes.extend(notes)
    return write_our_checkpoint(opts.save_dir, shards, payload.dims, payload.args, iteration=payload.iteration,
                                consumed_samples=payload.consumed_samples, optimizer_by_name=optimizer,
                                scheduler=scheduler, rng=rng, release=release,
                                optimizer_kind=opts.target_optimizer_layout)
