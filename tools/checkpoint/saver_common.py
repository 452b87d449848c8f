"""Shared by the ``ours`` and ``megatron`` savers: the target layout's model shards and optimizer state."""

from megatron.core.checkpoint_formats import CheckpointFormatError, reshard_named, split_tp_pp


def target_layout(opts, payload):
    tp = opts.target_tensor_parallel_size or payload.source_layout[0]
    pp = opts.target_pipeline_parallel_size or payload.source_layout[1]
    return tp, pp


def shards_and_state(opts, payload):
    """``(model shards, optimizer by name or None, scheduler, rng, release, notes)`` for the target layout."""
    tp, pp = target_layout(opts, payload)
    dims, family = payload.dims, payload.family
    shards = split_tp_pp(payload.full, dims, tp, pp, family)
    notes = []
    optimizer = scheduler = rng = None
    if opts.reshard_optimizer:
        if not payload.optimizer_ranks:
            raise CheckpointFormatError(f"--reshard-optimizer: {opts.load_dir} holds no optimizer state")
        named = {rank: n for rank, (n, _) in payload.optimizer_ranks.items()}
        meta = payload.optimizer_ranks[min(payload.optimizer_ranks)][1]
        resharded = reshard_named(named, dims, tp, pp, family)
        optimizer = {rank: (n, meta) for rank, n in resharded.items()}
        scheduler = payload.scheduler
        if payload.rng and (tp, pp) == payload.source_layout:
            rng = payload.rng
        elif payload.rng:
            notes.append("RNG state dropped: it belongs to the source layout's ranks (resume with --no-load-rng)")
        if dims.padded_for(tp) != dims.padded_vocab_size:
            notes.append(f"vocabulary padding {dims.padded_vocab_size} -> {dims.padded_for(tp)} rows: new rows are "
                         "zeros; the softmax over the padded vocabulary changes the loss slightly")
    release = optimizer is None
    return shards, optimizer, scheduler, rng, release, notes
