"""The layout planner: predicted memory and time of a training layout before launch (``tools/plan.py``)."""

from megatron.core.planner.memory import peak_memory, stage_memory, state_bytes  # noqa: F401
from megatron.core.planner.shapes import Cluster, Layout, ModelShape, check_layout  # noqa: F401
from megatron.core.planner.predict import (  # noqa: F401
    Prediction, SearchSpace, format_prediction, format_table, predict, search,
)
from megatron.core.planner.timing import load_calibration  # noqa: F401
