"""Model weights of Megatron-Core ``torch_dist`` checkpoints (``*.distcp`` + ``.metadata`` + ``common.pt``).

The tensors are read with ``torch.distributed.checkpoint`` in a single process (``no_dist``): each is stored at
its global (unsharded) shape, so any saved TP/PP layout reads the same way. The ``.metadata`` file is a pickle of
``torch.distributed.checkpoint`` dataclasses; it is unpickled through an allowlist of those classes, and
``common.pt`` (the pickled arguments) through the Megatron-LM allowlist of ``safe_load``.

Layout facts: the transformer layers are stacked into one tensor per parameter with the layer as the leading
dimension (``decoder.layers.self_attention.linear_qkv.weight`` is ``[L, 3h, h]``), the pre-attention and pre-MLP
norms are named after the linear they precede (``…linear_qkv.layer_norm_weight``, ``…linear_fc1.layer_norm_bias``),
and ``_extra_state`` entries are byte blobs. Optimizer state is not read.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Dict, Optional

import torch

from megatron.core.checkpoint_formats.common import LoadedCheckpoint, read_tracker
from megatron.core.checkpoint_formats.layout import GPT, ModelFamily, check_supported_args
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError, load_megatron_file, to_plain

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}
# torch_dist name (layer-relative) -> ours, where they differ
_RENAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
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


def read_torch_dist_checkpoint(root: str, family: ModelFamily = GPT,
                               args: Optional[dict] = None) -> LoadedCheckpoint:
    """The model of a torch_dist checkpoint folder as one full state dict (``{(0, 0): [full]}``).

    ``args``: the model's arguments when ``common.pt`` holds none (it does in Megatron-LM's own checkpoints)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration, iter_dir = read_tracker(root)
    if not is_torch_dist(iter_dir):
        raise CheckpointFormatError(f"{iter_dir} has no .metadata: not a torch_dist checkpoint")
    metadata = read_dcp_metadata(iter_dir)
    common_path = os.path.join(iter_dir, "common.pt")
    common = load_megatron_file(common_path) if os.path.isfile(common_path) else {}
    saved_args = to_plain(common.get("args")) if isinstance(common, dict) and common.get("args") is not None else None
    args = dict(saved_args or args or {})
    check_supported_args(args, common_path)

    wanted = {k: m for k, m in metadata.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(_MODEL_PREFIXES)}
    if not wanted:
        raise CheckpointFormatError(f"{iter_dir}: the torch_dist checkpoint holds no model tensors")
    buffers = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in wanted.items()}

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *a, **kw):
            return metadata

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(buffers, storage_reader=_SafeReader(iter_dir), no_dist=True)
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
    full = {n: full[n] for n in order}
    extra = {"format": "torch_dist", "iter_dir": iter_dir, "args_from_checkpoint": saved_args is not None}
    return LoadedCheckpoint({(0, 0): [full]}, None, None, None, iteration,
                            int(args.get("consumed_train_samples") or 0), args, extra)
