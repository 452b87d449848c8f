import pytest

from megatron.core.parallel_state import ParallelState, validate_parallel_sizes
from tests.dist_utils import run_distributed


def test_validate_names_flags():
    assert validate_parallel_sizes(8, 2, 2) == 2
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        validate_parallel_sizes(6, 4, 1)
    with pytest.raises(ValueError, match="--virtual-pipeline-model-parallel-size"):
        validate_parallel_sizes(4, 1, 1, 2)


def _grid(rank, world, tp, pp):
    ps = ParallelState.build(tp, pp)
    dp = world // (tp * pp)
    assert (ps.tp_size, ps.pp_size, ps.dp_size) == (tp, pp, dp)
    # TP innermost, then DP, then PP
    assert rank == ps.pp_rank * dp * tp + ps.dp_rank * tp + ps.tp_rank
    assert ps.tp_ranks == [rank - ps.tp_rank + t for t in range(tp)]
    assert ps.pp_ranks[ps.pp_rank] == rank and len(ps.pp_ranks) == pp
    assert ps.dp_ranks[ps.dp_rank] == rank and len(ps.dp_ranks) == dp
    if ps.is_pipeline_first_stage or ps.is_pipeline_last_stage:
        assert ps.embedding_ranks == sorted({ps.pp_ranks[0], ps.pp_ranks[-1]}) and ps.in_embedding_group
    else:
        assert ps.embedding_ranks == [] and not ps.in_embedding_group


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4), (4, 1)])
def test_grid_layout(tp, pp):
    run_distributed(_grid, 4, (tp, pp))
