"""``--saver megatron``: a Megatron-LM legacy torch checkpoint at the target TP/PP."""

from megatron.core.checkpoint_formats import write_megatron_checkpoint
from megatron.core.checkpoint_formats.megatron_state import rng_to_megatron
from saver_common import shards_and_state


def save(opts, payload) -> list:
    shards, optimizer, scheduler, rng, release, notes = shards_and_state(opts, payload)
    if rng and any(rng_to_megatron(r) is None for r in rng.values()):
        notes.append("RNG state not written: it has no CUDA part (a CPU run); Megatron-LM resumes with "
                     "--no-load-rng")
    payload.notes.extend(notes)
    return write_megatron_checkpoint(opts.save_dir, shards, payload.dims, payload.args, iteration=payload.iteration,
                                     consumed_samples=payload.consumed_samples, family=payload.family,
                                     optimizer_by_name=optimizer, scheduler=scheduler, rng=rng, release=release)
