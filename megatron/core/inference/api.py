"""Requests and responses of the generation server: Megatron-LM's ``PUT /api`` and OpenAI-style completions.

``parse_megatron_request`` and ``parse_completions_request`` turn a decoded JSON body into a ``Job`` (prompts
as token ids plus ``SamplingParams``) or raise ``RequestError`` with the HTTP status and a one-line message
naming the field. Every field's type and range is checked; unknown fields are refused, so a misspelled option
is never silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional

from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.start_token import with_start_token


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 64  # prompts per request
    max_positions: int = 1024  # prompt tokens + tokens to generate (the model's positions)
    max_prompt_chars: int = 100_000  # characters of one prompt, checked before tokenizing
    max_stop_strings: int = 4


@dataclass
class Job:
    prompts: List[List[int]]
    texts: List[str]
    params: SamplingParams
    echo: bool = True  # Megatron's text is prompt + continuation; OpenAI's only with echo


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, key: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    v = body.get(key, default)
    if v is None:
        return None
    if not _is_int(v):
        raise RequestError(f"{key} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if not _is_number(v):
        raise RequestError(f"{key} must be a finite number, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {type(v).__name__}")
    return v


def _check_fields(body: Any, allowed: set, unsupported: dict) -> None:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key in unsupported:
            raise RequestError(f"{key} is not supported ({unsupported[key]})")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(sorted(allowed))}")


def _prompt_list(value: Any, key: str, limits: Limits) -> List[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError(f"{key} must be a non-empty list of strings")
    if len(value) > limits.max_prompts:
        raise RequestError(f"too many prompts: {len(value)} (at most {limits.max_prompts})")
    for i, p in enumerate(value):
        if not isinstance(p, str):
            raise RequestError(f"{key}[{i}] must be a string, got {type(p).__name__}")
        if len(p) > limits.max_prompt_chars:
            raise RequestError(f"{key}[{i}] has {len(p)} characters (at most {limits.max_prompt_chars})")
    return value


def _tokenize(texts: List[str], tokenizer, add_bos: bool, max_new: int, limits: Limits, key: str):
    prompts = []
    for i, text in enumerate(texts):
        ids = tokenizer.tokenize(text)
        if add_bos:  # the beginning-of-text token, or the end-of-document one for tokenizers without it
            ids = with_start_token(tokenizer, ids)
        if not ids:
            raise RequestError(f"{key}[{i}] is empty (give text, or add_BOS to start from the beginning-of-text "
                               "token)")
        _check_length(len(ids), max_new, limits, f"{key}[{i}]")
        prompts.append(ids)
    return prompts


def _check_length(n: int, max_new: int, limits: Limits, name: str) -> None:
    if n + max_new > limits.max_positions:
        raise RequestError(f"{name} has {n} tokens; with {max_new} tokens to generate that exceeds the model's "
                           f"{limits.max_positions} positions")


_MEGATRON_FIELDS = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "top_p_decay",
                    "top_p_bound", "logprobs", "random_seed", "stop_on_eol", "stop_on_double_eol", "add_BOS",
                    "no_log", "stop"}
_MEGATRON_UNSUPPORTED = {"beam_width": "beam search", "length_penalty": "beam search",
                         "prevent_newline_after_colon": "newline suppression", "stop_token": "use stop strings"}


def parse_megatron_request(body: Any, tokenizer, limits: Limits) -> Job:
    """Megatron-LM's ``PUT /api`` body: ``prompts``, ``tokens_to_generate`` (default 64), ``temperature``
    (0 = greedy, up to 100), ``top_k``, ``top_p``, ``logprobs``, ``random_seed``, ``stop_on_eol``,
    ``stop_on_double_eol``, ``add_BOS``, ``stop`` (extra stop strings), ``no_log``."""
    _check_fields(body, _MEGATRON_FIELDS, _MEGATRON_UNSUPPORTED)
    if "prompts" not in body:
        raise RequestError("prompts is required")
    texts = _prompt_list(body["prompts"], "prompts", limits)
    max_new = _int(body, "tokens_to_generate", min(64, limits.max_positions), 0, limits.max_positions)
    logprobs = _bool(body, "logprobs", False)
    if max_new == 0 and not logprobs:
        raise RequestError("tokens_to_generate 0 only makes sense with logprobs true")
    temperature = _float(body, "temperature", 1.0, 0.0, 100.0)
    top_k = _int(body, "top_k", 0, 0, 1000)
    top_p = _float(body, "top_p", 0.0, 0.0, 1.0)
    for key in ("top_p_decay", "top_p_bound"):
        if _float(body, key, 0.0, 0.0, 1.0) != 0.0:
            raise RequestError(f"{key} is not supported (only 0)")
    if top_k and top_p:
        raise RequestError("give top_k or top_p, not both")
    seed = _int(body, "random_seed", None, 0, 2**63 - 1)
    stops = _stop_strings(body.get("stop"), "stop", limits)
    if _bool(body, "stop_on_double_eol", False):
        stops = stops + ("\n\n",)
    _bool(body, "no_log", False)
    add_bos = _bool(body, "add_BOS", False)
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop_on_eod=True, stop_on_eol=_bool(body, "stop_on_eol", False), stop_strings=stops,
                            logprobs=logprobs)
    return Job(_tokenize(texts, tokenizer, add_bos, max_new, limits, "prompts"), texts, params, echo=True)


def _stop_strings(value: Any, key: str, limits: Limits) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError(f"{key} must be a non-empty string or a list of non-empty strings")
    if len(value) > limits.max_stop_strings:
        raise RequestError(f"{key} holds {len(value)} strings (at most {limits.max_stop_strings})")
    return tuple(value)


def _completion_prompts(value: Any, tokenizer, limits: Limits) -> tuple:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids, or a list of lists of token ids.
    Returns ``(texts, token-id prompts or None)``; token-id prompts are kept as given and their text is decoded."""
    def is_ids(v):
        return isinstance(v, list) and all(_is_int(t) for t in v)

    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not (isinstance(value, list) and value and all(is_ids(p) for p in value)):
        return _prompt_list(value, "prompt", limits), None
    if len(value) > limits.max_prompts:
        raise RequestError(f"too many prompts: {len(value)} (at most {limits.max_prompts})")
    vocab = tokenizer.vocab_size
    for i, ids in enumerate(value):
        if not ids:
            raise RequestError(f"prompt[{i}] is an empty list of token ids")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt[{i}] holds token id {bad}, outside the vocabulary [0, {vocab})")
    return [tokenizer.detokenize(ids) for ids in value], value


_OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "logprobs", "echo",
                  "seed", "stream", "user", "presence_penalty", "frequency_penalty", "best_of"}


def parse_completions_request(body: Any, tokenizer, limits: Limits) -> Job:
    """An OpenAI ``/v1/completions`` body (``prompt`` as text or token ids, ``max_tokens`` default 16,
    ``temperature`` default 1, ``top_p``, ``top_k``, ``stop``, ``logprobs`` 0-5, ``echo``, ``seed``);
    ``n``/``best_of`` 1, no streaming, no penalties. With ``echo`` and ``logprobs`` the prompt's positions get their
    log-probs and most likely tokens too."""
    _check_fields(body, _OPENAI_FIELDS, {})
    if "prompt" not in body:
        raise RequestError("prompt is required")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError(f"model must be a string, got {type(body['model']).__name__}")
    if "user" in body and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {type(body['user']).__name__}")
    texts, ids = _completion_prompts(body["prompt"], tokenizer, limits)
    max_new = _int(body, "max_tokens", 16, 0, limits.max_positions)
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _int(body, "top_k", 0, 0, 1000)
    if top_k and top_p < 1.0:
        raise RequestError("give top_k or top_p, not both")
    for key in ("n", "best_of"):
        if _int(body, key, 1, 1, 1) != 1:
            raise RequestError(f"{key} must be 1")
    if _bool(body, "stream", False):
        raise RequestError("stream true is not supported")
    for key in ("presence_penalty", "frequency_penalty"):
        if _float(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise RequestError(f"{key} is not supported (only 0)")
    n_logprobs = _int(body, "logprobs", None, 0, 5)
    echo = _bool(body, "echo", False)
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=top_k,
                            top_p=0.0 if top_p >= 1.0 else top_p, seed=_int(body, "seed", None, 0, 2**63 - 1),
                            stop_strings=_stop_strings(body.get("stop"), "stop", limits),
                            logprobs=n_logprobs is not None, top_logprobs=n_logprobs or 0,
                            prompt_top_logprobs=echo and bool(n_logprobs))
    if temperature > 0.0 and top_p == 0.0:
        raise RequestError("top_p must be > 0")
    if max_new == 0 and not echo:
        raise RequestError("max_tokens 0 needs echo true (scoring the prompt)")
    if ids is None:
        ids = _tokenize(texts, tokenizer, False, max_new, limits, "prompt")
    else:
        for i, prompt in enumerate(ids):
            _check_length(len(prompt), max_new, limits, f"prompt[{i}]")
    return Job(ids, texts, params, echo=echo)


def megatron_response(job: Job, outputs, tokenizer) -> dict:
    """``{"text": [prompt + continuation], "tokens": [[prompt and generated ids]], "segments": [[token strings]],
    "logprobs": [[...]]}``, as Megatron-LM's server answers."""
    texts, segments, logprobs = [], [], []
    for prompt, out in zip(job.texts, outputs):
        texts.append(prompt + out.text)
        segments.append([tokenizer.detokenize([t]) for t in out.tokens])
        logprobs.append(out.logprobs)
    response = {"text": texts, "tokens": [out.tokens for out in outputs], "segments": segments}
    if job.params.logprobs:
        response["logprobs"] = logprobs
    return response


def completions_response(job: Job, outputs, tokenizer, model_name: str, request_id: str, created: int) -> dict:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, (prompt, out) in enumerate(zip(job.texts, outputs)):
        prompt_tokens += out.prompt_length
        completion_tokens += len(out.generated)
        choice = {"index": i, "text": (prompt if job.echo else "") + out.text, "logprobs": None,
                  "finish_reason": "length" if out.finish_reason == "length" else "stop"}
        if job.params.logprobs:
            shown = out.tokens if job.echo else out.generated
            lps = ([None] + out.logprobs) if job.echo else out.logprobs[out.prompt_length - 1:]
            tops = out.top_logprobs or [[] for _ in out.generated]
            if job.echo:  # the first token has no log-prob, as in OpenAI's answers
                tops = [None] + (out.prompt_top_logprobs or [[] for _ in range(out.prompt_length - 1)]) + tops
            strings = [tokenizer.detokenize([t]) for t in shown]
            offsets, pos = [], len(prompt) if not job.echo else 0
            for s in strings:
                offsets.append(pos)
                pos += len(s)
            choice["logprobs"] = {
                "tokens": strings, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [None if t is None else {tokenizer.detokenize([tid]): lp for tid, lp in t}
                                 for t in tops] if job.params.top_logprobs else None,
            }
        choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}
