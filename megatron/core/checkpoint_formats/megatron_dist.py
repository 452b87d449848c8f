"""Megatron-Core ``torch_dist`` checkpoints (``*.distcp`` + ``.metadata`` + ``common.pt``), as Megatron-LM's training
script writes them with ``--ckpt-format torch_dist``: model weights, the distributed optimizer's state, the
scheduler and the RNG state.

Everything is read with ``torch.distributed.checkpoint`` in a single process (``no_dist``): each tensor is stored at
its global (unsharded) shape, so any saved TP/PP layout reads the same way. Nothing is unpickled beyond data:

- ``.metadata`` pickles ``torch.distributed.checkpoint`` dataclasses; Megatron-Core 0.15's writer pickles its own
  subclass ``MCoreMetadata`` (the same fields plus ``mcore_data`` and ``all_local_plans`` of ``MCoreSavePlan``).
  It is unpickled through an allowlist of those classes, Megatron-Core's two mapped to inert stand-ins here.
- ``common.pt`` (``args``, ``iteration``, ``opt_param_scheduler``, the optimizer's sharding type, ...) and each
  sharded object (``rng_state``, the distributed optimizer's param groups: ``torch.save`` bytes inside the
  ``.distcp`` files, each a one-element list of the object) go through the Megatron-LM allowlist of ``safe_load``;
  torch's own reader would unpickle the objects with ``weights_only=False``, so they are fetched as raw bytes.

Layout facts: the transformer layers are stacked into one tensor per parameter with the layer as the leading
dimension (``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, 3h, h]``), the pre-attention and pre-MLP
norms are named after the linear they precede (``…linear_qkv.layer_norm_weight``, ``…linear_fc1.layer_norm_bias``),
and ``_extra_state`` entries are byte blobs. The distributed optimizer's default sharding in Megatron-LM
(``dp_reshardable``) stores, per model-parallel group ``dp_group_idx_G``, grad buffer ``gbuf_idx_B`` of dtypes
``(param, grad)`` and bucket ``bucket_idx_K``, one flat fp32 tensor for each of ``param`` (the main copy),
``exp_avg`` and ``exp_avg_sq``: the bucket's parameters at their grad-buffer offsets without the bucket's end
padding, so the buckets of a buffer concatenated are the flat buffer of the legacy ``distrib_optim.pt``
(``distrib_optim.py`` cuts it by parameter); the param groups (with the step) are the sharded object
``optimizer.distributed.dp_group_idx_G.optimizer``. ``rng_state`` is a sharded object over (PP, TP) holding the
per-data-parallel-rank list of the legacy format.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pickle
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from megatron.core.checkpoint_formats.common import (LoadedCheckpoint, read_tracker, to_family_order,
                                                     write_tracker)
from megatron.core.checkpoint_formats.distrib_optim import (buffer_buckets, distributed_optimizer_groups,
                                                             hyper_from_distributed, own_bucket_names,
                                                             per_param_from_buffers, write_distrib_optim)
from megatron.core.checkpoint_formats.layout import GPT, ModelDims, ModelFamily, check_supported_args
from megatron.core.checkpoint_formats.megatron_state import (rng_from_megatron, rng_to_megatron,
                                                             scheduler_from_megatron, scheduler_to_megatron)
from megatron.core.checkpoint_formats.optimizer_state import named_from_keys, named_to_ours
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file, to_plain


@dataclasses.dataclass
class MCoreMetadata(Metadata):
    """Stand-in for Megatron-Core's ``MCoreMetadata``: torch's checkpoint metadata plus Megatron-Core's extras."""

    mcore_data: Optional[dict] = None
    all_local_plans: Optional[list] = None


class MCoreSavePlan:
    """Stand-in for Megatron-Core's ``MCoreSavePlan`` (its attributes only; never used here)."""


_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # torch's own writer records the folder in ``storage_meta``
}
_MCORE_CLASSES = {"megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata": MCoreMetadata,
                                                                         "MCoreSavePlan": MCoreSavePlan}}
# torch_dist name (layer-relative) -> ours, where they differ
_RENAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(torch\.(\w+), "
                     r"torch\.(\w+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer"
_GRAD_SCALER = "optimizer.distributed.dp_group_idx_0.grad_scaler"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        stand_in = _MCORE_CLASSES.get(module, {}).get(name)
        if stand_in is not None:
            return stand_in
        allowed = name in _DCP_CLASSES.get(module, set())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise CheckpointFormatError(f"refusing to load {self.path}: it needs the unpickling global "
                                        f"{module}.{name}, which is not a torch.distributed.checkpoint class")
        return super().find_class(module, name)


def read_dcp_metadata(iter_dir: str):
    path = os.path.join(iter_dir, ".metadata")
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f, path).load()
        except CheckpointFormatError:
            raise
        except Exception as exc:
            raise CheckpointFormatError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def is_torch_dist(iter_dir: str) -> bool:
    return os.path.isfile(os.path.join(iter_dir, ".metadata"))


def _read_items(iter_dir: str, metadata, keys: List[str]) -> Dict[str, Any]:
    """The checkpoint's entries ``keys``: tensors at their global shape, sharded objects as raw bytes."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *a, **kw):
            return metadata

    class _RawBytesPlanner(DefaultLoadPlanner):
        """Keeps a sharded object's bytes as they are (torch's planner would unpickle them without limits)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = io.BytesIO(value.read())

    entries = metadata.state_dict_metadata
    buffers: Dict[str, Any] = {k: (torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype)
                                   if isinstance(entries[k], TensorStorageMetadata) else io.BytesIO())
                               for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(buffers, storage_reader=_SafeReader(iter_dir), planner=_RawBytesPlanner(flatten_state_dict=False), no_dist=True)
    return buffers


def _sharded_object(iter_dir: str, metadata, key: str, offsets: str = "") -> Optional[Any]:
    """The object saved as ``key`` (the shard at ``offsets``, e.g. ``0.0``; any shard when empty), unpickled
    through the allowlist; ``None`` when the checkpoint has none."""
    found = sorted(k for k in metadata.state_dict_metadata
                   if k.startswith(f"{key}/shard_{offsets}") or (k == key and not offsets))
    if not found:
        return None
    where = os.path.join(iter_dir, found[0])
    value = load_megatron_file(where, data=_read_items(iter_dir, metadata, found[:1])[found[0]])
    if not isinstance(value, list) or len(value) != 1:
        raise CheckpointFormatError(f"{where}: a sharded object's bytes hold a one-element list, found "
                                    f"{type(value).__name__}")
    return value[0]


def _model_state(buffers: Dict[str, torch.Tensor], family: ModelFamily, iter_dir: str) -> Dict[str, torch.Tensor]:
    full: Dict[str, torch.Tensor] = {}
    stacked_prefix = family.layer_prefix  # "decoder.layers."
    for key, value in buffers.items():
        if key.startswith(stacked_prefix):
            rel = _RENAMES.get(key[len(stacked_prefix):], key[len(stacked_prefix):])
            for i in range(value.shape[0]):  # [L, ...] -> one tensor per layer
                full[family.layer_name(i, rel)] = value[i].clone()
        else:
            full[key] = value
    for name in full:
        if not family.known(name):
            raise CheckpointFormatError(f"{iter_dir}: unknown {family.name} parameter {name} in the torch_dist "
                                        "checkpoint")
    order = [n for n in family.full_order(1 + max(family.split_layer_name(n)[0] or 0 for n in full), False)
             if n in full]
    return {n: full[n] for n in order}


def _optimizer_by_name(iter_dir: str, metadata, common: dict, full: Dict[str, torch.Tensor], args: Dict[str, Any],
                       family: ModelFamily):
    """``(named, meta)`` of the distributed optimizer's ``dp_reshardable`` state (see the module's docstring)."""
    where = os.path.join(iter_dir, "common.pt")
    sharding = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if sharding != "dp_reshardable":
        kind = f"the sharding {sharding!r}" if sharding else "a non-distributed optimizer"
        raise CheckpointFormatError(f"{iter_dir}: the optimizer state of this torch_dist checkpoint ({kind}) is not "
                                    "read, only the distributed optimizer's dp_reshardable state (Megatron-LM's "
                                    "default); resume it with --no-load-optim")
    buckets = {k: _BUCKET.match(k) for k in metadata.state_dict_metadata}
    buckets = {k: m for k, m in buckets.items() if m}
    groups = sorted({int(m.group(1)) for m in buckets.values()})
    if groups != [0]:
        raise CheckpointFormatError(f"{iter_dir}: the distributed optimizer's state is saved per model-parallel "
                                    f"group ({len(groups)} groups: TP x PP > 1); only a TP=1, PP=1 run's state is "
                                    "read; resume it with --no-load-optim")
    values = _read_items(iter_dir, metadata, sorted(buckets))
    state: Dict[Any, Any] = {"buckets_coalesced": True}
    for key in sorted(buckets, key=lambda k: (int(buckets[k].group(2)), int(buckets[k].group(5)))):
        _, gbuf, pdt, gdt, _, which = buckets[key].groups()
        entry = state.setdefault(int(gbuf), {}).setdefault((getattr(torch, pdt), getattr(torch, gdt)), {})
        entry.setdefault(which, []).append(values[key])
    for per_dtype in (v for k, v in state.items() if isinstance(k, int)):
        for entry in per_dtype.values():
            for which in ("param", "exp_avg", "exp_avg_sq"):
                entry[which] = torch.cat(entry.get(which, []) or [torch.empty(0)])
            entry["numel_unpadded"] = entry["param"].numel()
    mg_chunks = [to_family_order(full, family, megatron=True)]
    per_key = per_param_from_buffers(state, os.path.join(iter_dir, "__*.distcp"), mg_chunks, args, 0,
                                     own_bucket_names(args, family))
    param_groups = _sharded_object(iter_dir, metadata, _GROUPS)
    if param_groups is None:
        raise CheckpointFormatError(f"{iter_dir}: the distributed optimizer's param groups ({_GROUPS}) are missing")
    opt_sd = {"optimizer": param_groups}
    grad_scaler = _sharded_object(iter_dir, metadata, _GRAD_SCALER)
    hyper, step = hyper_from_distributed(opt_sd, where)
    meta = {"kind": "distributed", "param_groups": hyper, "step": step, "grad_scaler": grad_scaler}
    return named_from_keys(mg_chunks, per_key), meta


def read_torch_dist_checkpoint(root: str, family: ModelFamily = GPT, args: Optional[dict] = None,
                               load_optim: bool = True, load_rng: bool = True,
                               iteration: Optional[int] = None) -> LoadedCheckpoint:
    """A torch_dist checkpoint folder as one full-model rank ``(0, 0)``: model, optimizer (by name and as our
    distributed optimizer's state), scheduler, RNG (see the module's docstring for what is read).

    ``args``: the model's arguments when ``common.pt`` holds none (it does in Megatron-LM's own checkpoints);
    ``iteration``: read that one instead of the tracker's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if iteration is None:
        iteration, iter_dir = read_tracker(root)
    else:
        iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    if not is_torch_dist(iter_dir):
        raise CheckpointFormatError(f"{iter_dir} has no .metadata: not a torch_dist checkpoint")
    metadata = read_dcp_metadata(iter_dir)
    common_path = os.path.join(iter_dir, "common.pt")
    common = load_megatron_file(common_path) if os.path.isfile(common_path) else {}
    common = common if isinstance(common, dict) else {}
    saved_args = to_plain(common.get("args")) if common.get("args") is not None else None
    args = dict(saved_args or args or {})
    check_supported_args(args, common_path)

    wanted = [k for k, m in metadata.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(_MODEL_PREFIXES)]
    if not wanted:
        raise CheckpointFormatError(f"{iter_dir}: the torch_dist checkpoint holds no model tensors")
    full = _model_state(_read_items(iter_dir, metadata, wanted), family, iter_dir)

    named = optimizers = sched = rngs = None
    if load_optim and common.get("optimizer") is not None:
        n, meta = _optimizer_by_name(iter_dir, metadata, common, full, args, family)
        named = {(0, 0): (n, meta)}
        optimizers = {(0, 0): named_to_ours(n, meta, [full])}
        if common.get("opt_param_scheduler"):
            sched = scheduler_from_megatron(common["opt_param_scheduler"], args, common_path)
    if load_rng:
        rng_list = _sharded_object(iter_dir, metadata, "rng_state", "0.0")
        if rng_list is not None:
            rngs = {(0, 0): rng_from_megatron(rng_list, os.path.join(iter_dir, "rng_state"))}
    extra = {"format": "torch_dist", "iter_dir": iter_dir, "args_from_checkpoint": saved_args is not None,
             "optimizer_by_name": named, "megatron_scheduler": common.get("opt_param_scheduler"),
             "checkpoint_version": common.get("checkpoint_version"),
             "num_floating_point_operations_so_far": common.get("num_floating_point_operations_so_far")}
    return LoadedCheckpoint({(0, 0): [full]}, optimizers, sched, rngs, int(common.get("iteration", iteration)),
                            int(args.get("consumed_train_samples") or 0), args, extra)


# ---- write --------------------------------------------------------------------------------------------------------
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
             "chained_optim_avoid_prefix": True}


def _object_bytes(value: Any) -> list:
    """A sharded object as Megatron-Core stores it: a one-element list (torch's writer ``torch.save``s it)."""
    return [value]


def write_torch_dist_checkpoint(root: str, full: Dict[str, torch.Tensor], dims: ModelDims, args: argparse.Namespace,
                                iteration: int, family: ModelFamily = GPT, optimizer_by_name=None,
                                scheduler: Optional[dict] = None, rng: Optional[dict] = None,
                                num_floating_point_operations_so_far: float = 0.0) -> str:
    """Write the full model ``full`` (our names) as Megatron-LM's ``--ckpt-format torch_dist`` checkpoint of
    iteration ``iteration`` (``iter_NNNNNNN/`` and the tracker) and return the iteration folder.

    ``args``: the Namespace Megatron-LM stores (``megatron_lm.megatron_args``); ``optimizer_by_name``:
    ``(named, meta)`` of the full model, written as the distributed optimizer's ``dp_reshardable`` state (one
    model-parallel group, the buckets ``args``' DDP flags give); ``scheduler``: ours; ``rng``: ours."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _PlainWriter(FileSystemWriter):
        """Without the storage facts (a ``pathlib`` path) torch would pickle into ``.metadata``: data only."""

        def storage_meta(self):
            return None

    inverse = {ours: theirs for theirs, ours in _RENAMES.items()}
    layers = dims.num_layers
    items: Dict[str, Any] = {}
    for name, value in full.items():
        index, rel = family.split_layer_name(name)
        if index is None:
            items[name] = value.detach().contiguous()
    for rel in family.layer:
        if layers and family.layer_name(0, rel) not in full and family.is_optional(rel):
            continue  # a parameter the model's options leave out (e.g. per-head query/key norms)
        items[family.layer_prefix + inverse.get(rel, rel)] = torch.stack(
            [full[family.layer_name(i, rel)].detach() for i in range(layers)])
    for module in family.megatron_extra_state_layer:
        for i in range(layers):
            items[f"{family.layer_prefix}{module}._extra_state/shard_{i}_{layers}"] = _object_bytes(None)
    plain = vars(args)
    common: Dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                              "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
                              "content_metadata": dict(_SHARDING)}
    if optimizer_by_name is not None:
        named, meta = optimizer_by_name
        mg_chunks = [to_family_order(full, family, megatron=True)]
        per_key = {(c, n): e for c, chunk in enumerate(named) for n, e in chunk.items()}
        flat = write_distrib_optim(mg_chunks, per_key, plain, 0, own_bucket_names(plain, family))
        prefix = "optimizer.distributed.dp_group_idx_0"
        unpadded = []
        for gbuf, ((pdt, gdt), ends) in buffer_buckets(mg_chunks, plain, 0, own_bucket_names(plain, family)).items():
            entry = flat[gbuf][(pdt, gdt)]
            starts = [0] + ends[:-1]
            for b, (start, end) in enumerate(zip(starts, ends)):
                for which in ("param", "exp_avg", "exp_avg_sq"):
                    items[f"{prefix}.gbuf_idx_{gbuf}.dtype_({pdt}, {gdt}).bucket_idx_{b}.{which}"] = \
                        entry[which][start:end].clone()
            unpadded.append({(pdt, gdt): [end - start for start, end in zip(starts, ends)]})
        groups = distributed_optimizer_groups(meta)["optimizer"]
        items[f"{prefix}.optimizer/shard_0_1"] = _object_bytes(groups)
        items[f"{prefix}.per_bucket_numel_unpadded/shard_0_1"] = _object_bytes(unpadded)
        common["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}
        if meta.get("grad_scaler") is not None:
            items[f"{prefix}.grad_scaler/shard_0_1"] = _object_bytes(meta["grad_scaler"])
        if scheduler is not None:
            common["opt_param_scheduler"] = scheduler_to_megatron(scheduler, plain)
    if rng is not None:
        items["rng_state/shard_0.0_1.1"] = _object_bytes(rng_to_megatron(rng))
    iter_dir = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(iter_dir, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(items, storage_writer=_PlainWriter(iter_dir), planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)
    torch.save(common, os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as f:
        json.dump(_BACKEND, f)
    write_tracker(root, iteration, release=False)
    return iter_dir
