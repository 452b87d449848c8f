"""The training loop's order of work (Trainer.run) with the real step executors and a stand-in for the graph.

Under ``--enable-cuda-graph`` the loop launches step ``n + 1`` before it reads step ``n``'s results. These tests
run the real ``Trainer.run``, ``Trainer._may_run_ahead``, ``EagerStep`` and ``CudaGraphStep`` on CPU, with the
captured graph replaced by a recorder of launches and reads (``FullIterationCudaGraph`` needs a GPU), and check,
from the recorded order of launches, reads, evaluations and saves, that no evaluation or checkpoint ever sees a
later step already launched, that a step runs ahead wherever the rules allow, that an exit waits for the step in
flight, and that every step gets the learning rate of the eager loop, skipped steps included.
"""

import types

from megatron.training import training
from megatron.training.scheduler import OptimizerParamScheduler
from megatron.training.step_executor import CudaGraphStep, EagerStep
from megatron.training.watchdog import SkippedIterationGuard


class _Graph:
    """Stands in for FullIterationCudaGraph: records each launch (with the two learning-rate candidates it gets)
    and each read; captured at the third launch (two warm-up steps), as with --cuda-graph-warmup-steps 2."""

    def __init__(self, events, skipped):
        self.events, self.skipped, self.unread, self.launches = events, skipped, [], 0

    @property
    def replaying(self):
        return self.launches >= 3

    def launch(self, lrs_if_ok, lrs_if_skipped):
        self.launches += 1
        n = self.launches
        self.events.append(("launch", n, bool(self.unread), (lrs_if_ok, lrs_if_skipped)))
        self.unread.append(n)
        return n

    def finish(self, handle):
        assert self.unread and self.unread[0] == handle, "steps are read in launch order"
        self.unread.pop(0)
        self.events.append(("finish", handle))
        return {"lm loss": 1.0}, handle not in self.skipped, 1.0


class _Recorder(training.Trainer):
    """A Trainer whose step, evaluation, save and time check only record what the loop asks for."""

    def __init__(self, graph: bool, exit_for_time_at=None, skipped=(), **args):
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
        self.skip_guard = SkippedIterationGuard(0, fp16=False, fixed_loss_scale=None, min_loss_scale=1.0)  # never stops
        self.exit_for_time_at = exit_for_time_at
        self.events, self.skipped = [], set(skipped)
        self.graph = _Graph(self.events, self.skipped) if graph else None

    def make_step_executor(self):
        if self.graph is not None:
            return CudaGraphStep(self.graph, self.scheduler)
        return EagerStep(self._eager, self.scheduler)

    def _eager(self):
        n = len([e for e in self.events if e[0] == "launch"]) + 1
        lrs = self.scheduler.group_lrs(0)  # the rate the optimizer reads from its param groups
        assert lrs == [self.optimizer.param_groups[0]["lr"]]
        self.events += [("launch", n, False, (lrs, lrs)), ("finish", n)]
        return {"lm loss": 1.0}, n not in self.skipped, 1.0

    @property
    def unread(self):
        return self.graph.unread if self.graph is not None else []

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


def test_skipped_steps_get_the_learning_rates_of_the_eager_loop():
    skipped = {5, 6, 9}  # steps whose update is skipped (non-finite gradient): the schedule does not advance
    graph, eager = _Recorder(graph=True, skipped=skipped), _Recorder(graph=False, skipped=skipped)
    graph.run(0.0)
    eager.run(0.0)
    lr_eager = {e[1]: e[3][0] for e in eager.events if e[0] == "launch"}
    launches = [e for e in graph.events if e[0] == "launch"]
    for _, n, ahead, (if_ok, if_skipped) in launches:
        # what the captured graph computes on the device from the previous replay's found_inf
        lr = if_skipped if n - 1 in skipped else if_ok
        assert lr == lr_eager[n], n
        if not ahead:
            assert if_ok == if_skipped
    assert {n for _, n, ahead, _ in launches if ahead and n - 1 in skipped} == {6, 7, 10}, "the case is exercised"
    assert graph.scheduler.num_steps == eager.scheduler.num_steps == 12 - len(skipped)
    assert graph.skipped_iters == eager.skipped_iters == len(skipped)
