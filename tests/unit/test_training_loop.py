"""The training loop's order of work (Trainer.run), with the step itself replaced by a recorder.

Under ``--enable-cuda-graph`` the loop launches step ``n + 1`` before it reads step ``n``'s results. These tests
run the real ``Trainer.run`` and ``Trainer._may_run_ahead`` on CPU and check, from the recorded order of
launches, reads, evaluations and saves, that no evaluation or checkpoint ever sees a later step already
launched, that a step runs ahead wherever the rules allow, and that an exit waits for the step in flight.
"""

import types

from megatron.training import training
from megatron.training.scheduler import OptimizerParamScheduler


class _Graph:
    def __init__(self):
        self.launches = 0

    @property
    def replaying(self):  # captured at the third launch (two warm-up steps), as with --cuda-graph-warmup-steps 2
        return self.launches >= 3


class _Recorder(training.Trainer):
    """A Trainer whose step, evaluation, save and time check only record what the loop asks for."""

    def __init__(self, graph: bool, exit_for_time_at=None, **args):
        training_cfg = dict(train_iters=12, global_batch_size=8, eval_interval=None, exit_interval=None,
                            enable_cuda_graph=graph, check_for_nan_in_loss_and_grad=False)
        ckpt_cfg = dict(save="ckpt", save_interval=None)
        for key, value in args.items():
            (ckpt_cfg if key in ckpt_cfg else training_cfg)[key] = value
        self.train_cfg = types.SimpleNamespace(**training_cfg)
        self.ckpt_cfg = types.SimpleNamespace(**ckpt_cfg)
        self.log_cfg = types.SimpleNamespace(log_interval=1, log_throughput=False, tensorboard_log_interval=1)
        self.activation_shape = {"seq_length": 16}
        self.flops_per_iteration = 1.0
        self.pstate = types.SimpleNamespace(is_pipeline_last_stage=True, world_size=1)
        self.model = []
        self.optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0}], loss_scale_value=lambda: 1.0)
        self.scheduler = OptimizerParamScheduler(self.optimizer, 1.0, 0.1, 2, 12, "cosine", 0.0)
        self.tb = types.SimpleNamespace(scalars=lambda *a, **k: None)
        self.iteration = self.consumed_train_samples = self.skipped_iters = self.nan_iters = 0
        self.cuda_graph = _Graph() if graph else None
        self.exit_for_time_at = exit_for_time_at
        self.events, self.unread = [], []

    def launch_step(self, ahead: bool = False):
        n = len([e for e in self.events if e[0] == "launch"]) + 1
        assert ahead == bool(self.unread), "ahead must be set exactly when a launched step is still unread"
        # the learning rates the graph gets: this step's if the unread one updates, and if it is skipped
        lrs = (self.scheduler.group_lrs(1 if ahead else 0), self.scheduler.group_lrs(0))
        self.events.append(("launch", n, ahead, lrs))
        self.unread.append(n)
        if self.cuda_graph is not None:
            self.cuda_graph.launches += 1
        return n

    def finish_step(self, handle):
        assert self.unread and self.unread[0] == handle, "steps are read in launch order"
        self.unread.pop(0)
        self.events.append(("finish", handle))
        self.scheduler.step(1)
        return {"lm loss": 1.0}, True, 1.0

    def evaluate(self, split, label):
        self.events.append(("eval", self.iteration, len(self.unread)))

    def save(self):
        self.events.append(("save", self.iteration, len(self.unread)))

    def _should_exit_for_time(self, start):
        if self.exit_for_time_at is not None and self.iteration >= self.exit_for_time_at:
            return "exit-duration-in-mins"
        return None


def _ahead_launches(t):
    return sorted(e[1] for e in t.events if e[0] == "launch" and e[2])


def test_eager_loop_never_runs_ahead():
    t = _Recorder(graph=False, eval_interval=5, save_interval=4)
    out = t.run(0.0)
    assert out["iterations_run"] == 12 and _ahead_launches(t) == []
    assert [e[0] for e in t.events[:4]] == ["launch", "finish", "launch", "finish"]


def test_graph_runs_ahead_except_before_evaluation_checkpoints_and_the_end():
    t = _Recorder(graph=True, eval_interval=5, save_interval=4)
    out = t.run(0.0)
    assert out["iterations_run"] == 12 and out["exited"] is None
    # step n + 1 goes ahead once the graph replays (from the third launch on) unless step n evaluates (5, 10),
    # saves (4, 8) or is the last (12)
    assert _ahead_launches(t) == [4, 7, 8, 10, 12]
    evals = [e for e in t.events if e[0] == "eval"]
    saves = [e for e in t.events if e[0] == "save"]
    assert [e[1] for e in evals] == [5, 10] and [e[1] for e in saves] == [4, 8, 12]
    assert all(e[2] == 0 for e in evals + saves), "evaluation and checkpoints must see no later step launched"


def test_lr_of_a_step_launched_ahead_covers_both_outcomes_of_the_unread_one():
    t = _Recorder(graph=True)
    t.run(0.0)
    eager = _Recorder(graph=False)
    eager.run(0.0)
    lr_eager = {e[1]: e[3][0] for e in eager.events if e[0] == "launch"}
    for _, n, ahead, (if_ok, if_skipped) in (e for e in t.events if e[0] == "launch"):
        assert if_ok == lr_eager[n]  # every step updates here, so the "if ok" candidate is the eager schedule
        if ahead:  # the other candidate is the rate the step would get had step n - 1 been skipped
            assert if_skipped == lr_eager[n - 1]
        else:
            assert if_skipped == if_ok


def test_exit_waits_for_the_step_in_flight():
    t = _Recorder(graph=True, exit_for_time_at=7)
    out = t.run(0.0)
    # step 8 was launched ahead of reading step 7; it finishes and counts, then the run saves and exits
    assert out["exited"] == "exit-duration-in-mins" and out["iterations_run"] == 8 and t.iteration == 8
    assert t.events[-2:] == [("finish", 8), ("save", 8, 0)]
    assert not t.unread


def test_exit_interval_stops_running_ahead():
    t = _Recorder(graph=True, exit_interval=6)
    out = t.run(0.0)
    assert out["exited"] == "exit-interval" and t.iteration == 6
    assert t.events[-1] == ("save", 6, 0) and _ahead_launches(t) == [4, 5, 6]
