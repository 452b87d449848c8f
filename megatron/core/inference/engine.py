"""Batched text generation with a KV cache over this framework's GPT, on CPU or GPU, with tensor and pipeline
parallelism.

Every rank of the model-parallel group runs the same calls with the same arguments. Under tensor parallelism the
vocab-parallel logits are all-gathered so each rank sees the full vocabulary, and the chosen tokens are broadcast
from the group's first rank. Under pipeline parallelism every forward runs through the trainer's pipeline
schedule (``pipeline_forward``): each stage receives the previous stage's activations, runs its layers (their keys
and values in this rank's KV cache, ``kv_cache.KVCache``, the inference context of the forward) and sends its
output on; the last stage samples, and the chosen tokens (and at the end the log-probs) are broadcast from it to
every stage, so that all ranks continue identically.

The prompt pass runs the model once over the shortest prompt. Each later position is one static decoding step
(``decode_step.py``): the same shapes at every position, replayed from a CUDA graph on CUDA at pipeline size 1
(``use_cuda_graph``), run eagerly elsewhere. ``static_decode=False`` keeps the dynamic step, whose attention covers
only the positions filled so far: the reference the static step is tested against.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.collectives import backend_of
from megatron.core.inference.decode_step import StaticDecodeStep, static_capacity
from megatron.core.inference.kv_cache import KVCache, attention_shape, cache_device, cache_dtype
from megatron.core.inference.pipeline_forward import pipeline_forward
from megatron.core.inference.sampling import SamplingParams, sample_next
from megatron.core.parallel_state import ParallelState


@dataclass
class GenerationOutput:
    tokens: List[int]  # prompt then generated tokens
    prompt_length: int
    finish_reason: str  # "length", "eod", "eol" or "stop"
    logprobs: Optional[List[float]] = None  # log p(tokens[i] | tokens[:i]) for i >= 1
    text: Optional[str] = None  # the generated text (tokenizer given), cut before a matched stop string
    # per generated token: the top_logprobs most likely (token id, log-prob) pairs at its position
    top_logprobs: Optional[List[List[tuple]]] = None
    # the same per prompt token after the first (``prompt_top_logprobs``)
    prompt_top_logprobs: Optional[List[List[tuple]]] = None

    @property
    def generated(self) -> List[int]:
        return self.tokens[self.prompt_length:]


class InferenceEngine:
    """Generation and scoring over a GPT: the whole model, or this rank's pipeline stage of it (``pstate``).

    ``static_decode`` (default True): decode with the static step (position-independent shapes); False: the
    dynamic step. ``use_cuda_graph``: replay the static step from a CUDA graph; default (None) on when the model
    is on CUDA at pipeline size 1 (and the tensor-parallel group, if any, is NCCL). ``max_decode_steps``: how
    many static steps (each with its own key/value buffers and graph, one per batch size and capacity) are kept
    for later calls; the least recently used one is dropped beyond that.
    """

    def __init__(self, model: torch.nn.Module, pstate: Optional[ParallelState] = None, tokenizer=None,
                 vocab_size: Optional[int] = None, eod: Optional[int] = None, *, static_decode: bool = True,
                 use_cuda_graph: Optional[bool] = None, max_decode_steps: int = 2):
        self.pstate = pstate or ParallelState.single()
        if (model.pre_process and model.post_process) != (self.pstate.pp_size == 1):
            raise ValueError("the model must be the whole GPT at pipeline size 1, or this rank's stage of it")
        self.model = model.eval()
        self.first_stage, self.last_stage = model.pre_process, model.post_process
        self.tokenizer = tokenizer
        padded = model.config.padded_vocab_size
        self.vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer is not None else padded)
        if self.vocab_size > padded:
            raise ValueError(f"vocabulary {self.vocab_size} is larger than the model's {padded} output rows")
        self.eod = eod if eod is not None else (tokenizer.eod if tokenizer is not None else None)
        self.max_length = model.config.max_position_embeddings
        self.device = cache_device(model)
        self.cache = KVCache()  # the inference context of this engine's cached forwards
        self.static_decode = bool(static_decode)
        self.use_cuda_graph = self._graph_choice(use_cuda_graph)
        if max_decode_steps < 1:
            raise ValueError(f"max_decode_steps must be >= 1, got {max_decode_steps}")
        self.max_decode_steps = max_decode_steps
        self._steps: "OrderedDict[tuple, StaticDecodeStep]" = OrderedDict()

    def _graph_choice(self, asked: Optional[bool]) -> bool:
        """Whether to capture the static step: ``asked`` checked against the setup, or the default for it."""
        tp_nccl = self.pstate.tp_size == 1 or "nccl" in backend_of(self.pstate.tp_group)
        problem = None
        if self.device.type != "cuda":
            problem = f"the model is on {self.device.type}, not CUDA"
        elif not self.static_decode:
            problem = "it captures the static decoding step (static_decode=False was given)"
        elif self.pstate.pp_size > 1:
            problem = "pipeline stages exchange activations between steps (pipeline size > 1)"
        elif not tp_nccl:
            problem = "the tensor-parallel group is not NCCL"
        if asked and problem is not None:
            raise ValueError(f"use_cuda_graph: cannot capture the decoding step: {problem}")
        return problem is None if asked is None else bool(asked)

    def drop_decode_steps(self) -> None:
        """Free the kept static steps (their key/value buffers and graphs); later calls build new ones."""
        self._steps.clear()

    def _decode_step(self, batch: int, total: int) -> StaticDecodeStep:
        """The static step for ``batch`` sequences of ``total`` positions: a kept one, or a new one."""
        key = (batch, static_capacity(total, self.max_length))
        step = self._steps.pop(key, None)
        if step is None:
            while len(self._steps) >= self.max_decode_steps:
                self._steps.popitem(last=False)  # the least recently used
            step = StaticDecodeStep(self._step_logits, self.cache, batch, key[1], attention_shape(self.model),
                                    cache_dtype(self.model), self.device, self.use_cuda_graph)
        self._steps[key] = step  # now the most recently used
        return step

    def _step_logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        return self._logits(tokens, 0, last_only=True, positions=positions)  # [b, 1, V]

    # ---- forward passes ------------------------------------------------------------------------------
    @torch.no_grad()
    def stage_forward(self, tokens: torch.Tensor, start: int = 0, labels: Optional[torch.Tensor] = None,
                      positions: Optional[torch.Tensor] = None, cached: bool = False):
        """Run ``tokens [b, s]`` at positions ``start ..`` (or the device tensor ``positions [b, s]``) through the
        pipeline (``pipeline_forward``): the last stage returns the model's output (vocab-parallel logits
        ``[b, s, V/tp]``, or per-token losses ``[b, s]`` given ``labels``), the other stages ``None``.
        ``cached``: the tokens follow those in the engine's KV cache, and their keys and values join it."""
        b, s = tokens.shape
        if positions is None:
            positions = torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)  # [b, s]
        return pipeline_forward([self.model], self.pstate, tokens, positions, labels=labels,
                                inference_context=self.cache if cached else None)

    def _logits(self, tokens: torch.Tensor, start: int, last_only: bool = False,
                positions: Optional[torch.Tensor] = None, cached: bool = True) -> Optional[torch.Tensor]:
        """Full-vocabulary float32 logits ``[b, s, V_padded]`` (``[b, 1, V_padded]`` for the last position only)
        on the last stage, ``None`` elsewhere."""
        logits = self.stage_forward(tokens, start, positions=positions, cached=cached)  # [b, s, V/tp]
        if logits is None:
            return None
        if last_only:
            logits = logits[:, -1:]  # [b, 1, V/tp]: neither gathered nor copied for the other positions
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits, self.pstate.tp_group).float()

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits of a whole batch ``[b, s]`` recomputed without the cache (the reference path); under pipeline
        parallelism only the last stage gets them (``None`` elsewhere)."""
        return self._logits(tokens.to(self.device), 0, cached=False)

    def from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from the last pipeline stage to every stage (in place; identity without PP)."""
        if self.pstate.pp_size > 1:
            dist.broadcast(t, src=self.pstate.pp_ranks[-1], group=self.pstate.pp_group)
        return t

    # ---- generation ----------------------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new: int) -> List[int]:
        if not prompts:
            raise ValueError("no prompts given")
        lengths = [len(p) for p in prompts]
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            if n == 0:
                raise ValueError(f"prompt {i} is empty (needs at least one token)")
            if n + max_new > self.max_length:
                raise ValueError(f"prompt {i} has {n} tokens; with {max_new} new tokens that exceeds the model's "
                                 f"{self.max_length} positions")
            bad = [t for t in p if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return lengths

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.pstate.tp_size > 1:
            dist.broadcast(t, src=self.pstate.tp_src_rank, group=self.pstate.tp_group)
        return t

    def _detok(self, ids) -> str:
        return self.tokenizer.detokenize([int(i) for i in ids])

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[GenerationOutput]:
        """Continue each token-id prompt; all prompts share ``params``. Collective over the model-parallel group
        (every rank gets the same outputs)."""
        if (params.stop_on_eol or params.stop_strings) and self.tokenizer is None:
            raise ValueError("stop_on_eol and stop_strings need a tokenizer")
        if params.stop_on_eod and self.eod is None:
            raise ValueError("stop_on_eod needs the end-of-document id (give a tokenizer or eod)")
        max_new = params.max_new_tokens
        lengths = self._check_prompts(prompts, max_new)
        b, min_len, max_prompt = len(prompts), min(lengths), max(lengths)
        ends = [n + max_new for n in lengths]  # each sequence's last position + 1
        total = max(ends)
        pad = self.eod if self.eod is not None else 0
        tokens = torch.full((b, total), pad, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            tokens[i, :lengths[i]] = torch.tensor([int(t) for t in p], dtype=torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        logprobs = torch.zeros(b, total, dtype=torch.float32, device=self.device) if params.logprobs else None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else random.SystemRandom().randrange(2**62))
        finish = ["length"] * b
        stop_at = list(ends)  # where each output ends (exclusive)
        done = [max_new == 0] * b
        text_cut: List[Optional[int]] = [None] * b
        tops: List[List[list]] = [[] for _ in range(b)]
        prompt_tops: List[List[list]] = [[] for _ in range(b)]
        generated: List[List[int]] = [[] for _ in range(b)]  # host copy of each sequence's generated tokens
        # the device copy of ``done`` (remade when a sequence finishes), None while no sequence is done
        done_t = torch.tensor(done, device=self.device) if any(done) else None
        step = None
        if self.static_decode:
            step = self._decode_step(b, total)
            step.bind()
        else:
            self.cache.allocate(attention_shape(self.model), b, total, cache_dtype(self.model), self.device)
        try:
            prev, cur = 0, min_len
            while True:
                if step is not None and prev > 0:  # one position after the prompt pass
                    logits = step(tokens[:, prev:cur], prev)  # [b, 1, V]; None off the last stage
                else:
                    # [b, cur - prev, V] (or [b, 1, V] without log-probs); None off the last stage
                    logits = self._logits(tokens[:, prev:cur], prev, last_only=logprobs is None)
                self.cache.offset = cur
                if logprobs is not None and logits is not None and cur - prev > 1:  # prompt tokens in this chunk
                    # over the real vocabulary, as sampling is: padding rows (zeros after resharding) get no mass
                    lp = F.log_softmax(logits[:, :-1, :self.vocab_size].float(), dim=-1)  # [b, cur - prev - 1, V]
                    target = tokens[:, prev + 1:cur].unsqueeze(-1)  # [b, cur - prev - 1, 1]
                    logprobs[:, prev + 1:cur] = lp.gather(-1, target).squeeze(-1)
                    if params.prompt_top_logprobs:  # positions prev + 1 .. cur - 1 lie in every prompt
                        self._append_tops(lp, params, prompt_tops, [True] * b)
                if cur >= total or (all(done) and (logprobs is None or cur >= max_prompt)):
                    break
                if logits is not None:
                    chosen = self._broadcast(sample_next(logits[:, -1], params, self.vocab_size, gen))  # [b]
                else:
                    chosen = torch.empty(b, dtype=torch.long, device=self.device)
                chosen = self.from_last_stage(chosen)
                in_prompt = cur < lengths_t if cur < max_prompt else None  # [b] bool
                if in_prompt is not None:
                    chosen = torch.where(in_prompt, tokens[:, cur], chosen)
                if done_t is not None:
                    finished = done_t if in_prompt is None else done_t & ~in_prompt
                    chosen = chosen.masked_fill(finished, pad)
                tokens[:, cur] = chosen
                if logits is not None:
                    self._record_logprobs(logits[:, -1], chosen, cur, params, logprobs, tops,
                                          [not done[i] and cur >= lengths[i] for i in range(b)],
                                          prompt_tops, [cur < n for n in lengths])
                step_tokens = chosen.tolist()  # one device-to-host copy per step
                finished_now = False
                for i in range(b):
                    if done[i] or cur < lengths[i]:
                        continue
                    generated[i].append(step_tokens[i])
                    reason, cut = self._stop_reason(generated[i], params)
                    if reason is None and cur + 1 >= ends[i]:
                        reason = "length"
                    if reason is not None:
                        done[i], finish[i], stop_at[i], text_cut[i] = True, reason, cur + 1, cut
                        finished_now = True
                if finished_now:
                    done_t = torch.tensor(done, device=self.device)
                prev, cur = cur, cur + 1
        finally:
            self.cache.release()
        if logprobs is not None:
            logprobs = self.from_last_stage(logprobs)
        if params.top_logprobs and self.pstate.pp_size > 1:
            box = [(tops, prompt_tops)]
            dist.broadcast_object_list(box, src=self.pstate.pp_ranks[-1], group=self.pstate.pp_group)
            tops, prompt_tops = box[0]
        outputs = []
        tok_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        for i in range(b):
            out = GenerationOutput(tokens=tok_list[i][:stop_at[i]], prompt_length=lengths[i],
                                   finish_reason=finish[i])
            if lp_list is not None:
                out.logprobs = lp_list[i][1:stop_at[i]]
            if params.top_logprobs:
                out.top_logprobs = tops[i]
            if params.prompt_top_logprobs:
                out.prompt_top_logprobs = prompt_tops[i]
            if self.tokenizer is not None:
                text = self._detok(out.generated)
                out.text = text if text_cut[i] is None else text[:text_cut[i]]
            outputs.append(out)
        return outputs

    def _record_logprobs(self, last: torch.Tensor, chosen: torch.Tensor, cur: int, params: SamplingParams,
                         logprobs: Optional[torch.Tensor], tops: List[list], generating: List[bool],
                         prompt_tops: List[list], prompting: List[bool]) -> None:
        """Log-prob of each chosen token at position ``cur`` (from the logits ``last [b, V]`` before it) and the
        ``top_logprobs`` most likely tokens: into ``tops`` for the sequences generating there, into
        ``prompt_tops`` (with ``prompt_top_logprobs``) for those still in their prompt."""
        if logprobs is None and not params.top_logprobs:
            return
        lp = F.log_softmax(last[:, :self.vocab_size].float(), dim=-1)  # [b, V] over the real vocabulary
        if logprobs is not None:
            logprobs[:, cur] = lp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        if params.top_logprobs:
            self._append_tops(lp.unsqueeze(1), params, tops, generating)
        if params.prompt_top_logprobs:
            self._append_tops(lp.unsqueeze(1), params, prompt_tops, prompting)

    def _append_tops(self, lp: torch.Tensor, params: SamplingParams, into: List[list], active: List[bool]) -> None:
        """For each active sequence ``i``, append the ``top_logprobs`` most likely (id, log-prob) pairs of every
        position of ``lp [b, n, V]`` (log-probs over the real vocabulary) to ``into[i]``."""
        k = min(params.top_logprobs, self.vocab_size)
        top_vals, top_ids = torch.topk(lp[..., :self.vocab_size], k, dim=-1)  # [b, n, k]
        ids, vals = top_ids.tolist(), top_vals.tolist()
        for i, on in enumerate(active):
            if on:
                into[i].extend(list(zip(pos_ids, pos_vals)) for pos_ids, pos_vals in zip(ids[i], vals[i]))

    def _stop_reason(self, generated: List[int], params: SamplingParams):
        """``(reason, text cut)`` when the generated tokens end the sequence, else ``(None, None)``."""
        last = generated[-1]
        if params.stop_on_eod and last == self.eod:
            return "eod", None
        if params.stop_on_eol and "\n" in self._detok([last]):
            return "eol", None
        if params.stop_strings:
            text = self._detok(generated)
            hits = [text.find(s) for s in params.stop_strings if s and s in text]
            if hits:
                return "stop", min(hits)
        return None, None

    def generate_text(self, prompts: Sequence[str], params: SamplingParams) -> List[GenerationOutput]:
        """``generate`` on texts (tokenized with the engine's tokenizer)."""
        if self.tokenizer is None:
            raise ValueError("generate_text needs a tokenizer")
        return self.generate([self.tokenizer.tokenize(p) for p in prompts], params)
