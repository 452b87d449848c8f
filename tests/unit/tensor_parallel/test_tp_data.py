"""broadcast_data: TP rank 0 reads the batch, the rest of its TP group receives it."""

from collections import Counter

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import broadcast_data, count_collectives
from tests.dist_utils import run_distributed


def _batch(dp_rank, dtype):
    g = torch.Generator().manual_seed(100 + dp_rank)
    return {
        "text": torch.randint(0, 1000, (2, 9), generator=g).to(dtype),
        "loss_mask": torch.ones(2, 8, dtype=dtype),
        "scalar": torch.tensor(5 + dp_rank, dtype=dtype),  # 0-dim tensors keep their shape
    }


def _body(rank, world):
    for tp in (2, 4):
        ps = ParallelState.build(tensor_model_parallel_size=tp)
        for dtype in (torch.int64, torch.float32):
            want = _batch(ps.dp_rank, dtype)  # a different batch per DP replica
            data = want if ps.tp_rank == 0 else None
            with count_collectives() as c:
                got = broadcast_data(["text", "loss_mask", "scalar"], data, dtype, ps)
            assert c == Counter(broadcast=2)
            assert sorted(got) == ["loss_mask", "scalar", "text"]
            for k, v in want.items():
                assert got[k].dtype == dtype and torch.equal(got[k], v), k
        if ps.tp_rank == 0:
            with pytest.raises(ValueError, match="dtype"):
                broadcast_data(["text"], _batch(0, torch.int32), torch.int64, ps)
            with pytest.raises(ValueError, match="missing"):
                broadcast_data(["labels"], _batch(0, torch.int64), torch.int64, ps)


def test_broadcast_data_world4():
    run_distributed(_body, 4)


def test_broadcast_data_single_process():
    batch = _batch(0, torch.int64)
    got = broadcast_data(["text"], batch, torch.int64, ParallelState.single())
    assert list(got) == ["text"] and torch.equal(got["text"], batch["text"])
