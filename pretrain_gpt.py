"""Pretrain a GPT: the model provider, the batch and loss functions, then ``pretrain()``.

    torchrun --nproc_per_node N pretrain_gpt.py --num-layers 12 --hidden-size 768 ... --data-path PREFIX
    python pretrain_gpt.py ... --dry-run 64      # the planner's prediction for 64 GPUs; nothing is trained
"""

import sys
from functools import partial

import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.pipeline_parallel.partition import stage_chunks
from megatron.training.config import TrainingContext, transformer_config
from megatron.training.dry_run import print_dry_run, wants_dry_run
from megatron.training.setup import main_entry, print_rank_0, rank_0_first
from megatron.training.training import pretrain


def model_provider(ctx: TrainingContext):
    """Build this rank's model chunks (one per virtual pipeline stage), initialised layout-independently."""
    m, par, pstate = ctx.config.model, ctx.config.parallel, ctx.pstate
    config = transformer_config(m, ctx.config.precision, par.sequence_parallel, ctx.padded_vocab_size)
    chunks = []
    for c in stage_chunks(m.num_layers, pstate, par.decoder_first_pipeline_num_layers,
                          par.decoder_last_pipeline_num_layers):
        model = GPTModel(config, pstate, pre_process=c.pre_process, post_process=c.post_process,
                         num_layers=c.num_layers, layer_offset=c.layer_offset,
                         use_torch_compile=m.use_torch_compile, fused_cross_entropy=m.cross_entropy_loss_fusion)
        initialize_model_parameters(model, ctx.config.training.seed, config, pstate, layer_offset=c.layer_offset)
        chunks.append(model)
    return chunks


def get_batch(data_iterator, pstate, eod_mask_id, needs_data: bool):
    """Tokens, labels, loss mask and positions ``[b, s]``; TP rank 0 reads, the TP group receives.

    ``eod_mask_id``: the end-of-document id whose positions get no loss (``--eod-mask-loss``), or None.
    """
    if not needs_data:
        return None, None, None, None
    data = next(data_iterator) if pstate.tp_rank == 0 else None
    text = tensor_parallel.broadcast_data(["text"], data, torch.int64, pstate)["text"]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    text = text.to(device, non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [b, s] each
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    if eod_mask_id is not None:
        loss_mask[tokens == eod_mask_id] = 0.0
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)  # [b, s]
    return tokens, labels, loss_mask, position_ids


def loss_func(loss_mask, output_tensor):
    """Mean per-token loss of the microbatch over unmasked tokens."""
    losses = output_tensor.float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(ctx: TrainingContext, data_iterator, model):
    inner = getattr(model, "module", model)
    needs = inner.pre_process or inner.post_process
    eod_mask_id = ctx.eod_id if ctx.config.data.eod_mask_loss else None
    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, ctx.pstate, eod_mask_id, needs)
    output = model(tokens, position_ids, labels=labels if inner.post_process else None)
    return output, partial(loss_func, loss_mask)


def datasets_provider(ctx: TrainingContext, num_samples):
    """(train, valid, test): Megatron's GPT datasets over ``--data-path``, or ``--mock-data`` tokens."""
    d, seq, seed = ctx.config.data, ctx.config.model.seq_length, ctx.config.training.seed
    if d.mock_data:
        from megatron.training.mock_data import mock_gpt_datasets

        print_rank_0(f"> mock GPT datasets of random tokens for {num_samples} (train, valid, test) samples")
        return mock_gpt_datasets(num_samples, seq, ctx.tokenizer.vocab_size, seed)
    from megatron.core.datasets.builder import build_gpt_datasets, parse_data_path
    from megatron.core.datasets.checks import check_token_ids, sentence_level_warning

    print_rank_0(f"> building GPT datasets for {num_samples} (train, valid, test) samples")

    def build(first: bool):
        try:
            if first:  # once, at start-up: token ids against the embedding's rows, sentence-level data
                for prefix in parse_data_path(d.data_path)[0]:
                    check_token_ids(prefix, ctx.padded_vocab_size)
                    warning = sentence_level_warning(prefix, "GPT")
                    if warning is not None:
                        print(f"WARNING: {warning}", flush=True)
            return build_gpt_datasets(d.data_path, d.split, seq, seed, num_samples, cache_dir=d.data_cache_path,
                                      is_rank_0=first, barrier=None if first else (lambda: None))
        except OSError as exc:
            raise ValueError(f"building the GPT datasets of --data-path {' '.join(d.data_path)} "
                             f"(--data-cache-path {d.data_cache_path}): {exc}") from None

    # rank 0 builds (and caches) the indices first; its errors reach every rank as the same message
    return rank_0_first(build)


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if wants_dry_run(args):
        return print_dry_run(args, model="gpt")
    return pretrain(model_provider, forward_step, datasets_provider, argv=argv)


if __name__ == "__main__":
    main_entry(main)
