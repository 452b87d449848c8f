"""Schedules as pure functions, checked with no process group.

``execute_all`` plays every rank's action list against the others with the strictest semantics a
backend may have: a batch of sends/receives completes only once every op in it has been matched by the
peer's op (rendezvous), messages between two ranks match in posting order, and a rank runs nothing while
its batch is pending. Completing without deadlock, with every message arriving where it is expected, is
what the executor needs on gloo and NCCL.

``execute_grouped`` adds NCCL's model of a batch: one group, whose operations may progress in any order, so
it completes only together with the peers' batches that hold every matching operation, all posted at the
same time. A rank that merged a send of one phase with a receive of a later phase deadlocks there (it did
on two H200s before batches were split by phase).
"""

from collections import defaultdict

import pytest

from megatron.core.pipeline_parallel.actions import Action, ActionKind as K, steps
from megatron.core.pipeline_parallel.schedules import (
    build_schedule, compute_order, interleaved_schedule, num_warmup_microbatches, one_f_one_b_schedule,
)


def _message(pp, rank, a):
    """(peer, message id) of a communication action; the id names the tensor and the stage it is for."""
    stage = a.chunk * pp + rank
    if a.kind is K.SEND_FORWARD:
        return (rank + 1) % pp, ("act", a.microbatch, stage + 1)
    if a.kind is K.RECV_FORWARD:
        return (rank - 1) % pp, ("act", a.microbatch, stage)
    if a.kind is K.SEND_BACKWARD:
        return (rank - 1) % pp, ("grad", a.microbatch, stage - 1)
    return (rank + 1) % pp, ("grad", a.microbatch, stage)


def _programs(plans):
    """Each action list as the executor runs it: ('compute', action) and ('batch', [comm actions]) steps."""
    return [steps(plan) for plan in plans]


def execute_all(pp, num_microbatches, num_chunks, forward_only):
    """Run all ranks' schedules together under rendezvous semantics; return the plans."""
    num_stages = pp * num_chunks
    plans = [build_schedule(pp, r, num_microbatches, num_chunks, forward_only) for r in range(pp)]
    progs = _programs(plans)
    pc = [0] * pp
    posted = defaultdict(list)  # ("send"|"recv", src, dst) -> message ids in posting order
    pending = [None] * pp  # rank -> list of (direction key, index) of its posted batch
    have = [set() for _ in range(pp)]  # rank -> tensors it holds: ("act"/"grad", mb, stage)
    while any(pc[r] < len(progs[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            if pc[r] == len(progs[r]):
                continue
            step, what = progs[r][pc[r]]
            if step == "compute":
                a = what
                stage = a.chunk * pp + r
                if a.kind is K.FORWARD and stage > 0:
                    assert ("act", a.microbatch, stage) in have[r], f"rank {r} runs {a} before receiving its input"
                if a.kind is K.BACKWARD:
                    assert ("out", a.microbatch, stage) in have[r], f"rank {r} runs {a} before its forward"
                    if stage < num_stages - 1:
                        assert ("grad", a.microbatch, stage) in have[r], f"rank {r} runs {a} before its grad"
                have[r].add(("out" if a.kind is K.FORWARD else "igrad", a.microbatch, stage))
                pc[r] += 1
                progress = True
                continue
            if pending[r] is None:  # post the batch
                pending[r] = []
                for a in what:
                    peer, msg = _message(pp, r, a)
                    stage = a.chunk * pp + r
                    if a.kind.is_send:
                        need = "out" if a.kind is K.SEND_FORWARD else "igrad"
                        assert (need, a.microbatch, stage) in have[r], f"rank {r} sends {a} before computing it"
                        key = ("send", r, peer)
                    else:
                        key = ("recv", peer, r)
                    pending[r].append((key, len(posted[key])))
                    posted[key].append(msg)
                progress = True
            matched = all(len(posted[("recv" if k[0] == "send" else "send", k[1], k[2])]) > i for k, i in pending[r])
            if matched:
                for (k, i), a in zip(pending[r], what):
                    other = posted[("recv" if k[0] == "send" else "send", k[1], k[2])][i]
                    assert other == posted[k][i], f"rank {r}: {a} matched {other}, expected {posted[k][i]}"
                    if a.kind.is_recv:
                        have[r].add(posted[k][i])
                pending[r] = None
                pc[r] += 1
                progress = True
        assert progress, f"deadlock: ranks stuck at {[progs[r][pc[r]] if pc[r] < len(progs[r]) else '-' for r in range(pp)]}"
    for key, msgs in posted.items():  # every send has been received and vice versa
        other = ("recv" if key[0] == "send" else "send", key[1], key[2])
        assert msgs == posted[other], f"{key}: {msgs} vs {posted[other]}"
    return plans


def execute_grouped(pp, num_microbatches, num_chunks, forward_only):
    """Play all ranks with NCCL group semantics; assert that every batch completes."""
    progs = _programs([build_schedule(pp, r, num_microbatches, num_chunks, forward_only) for r in range(pp)])
    pc = [0] * pp
    count = defaultdict(int)  # (direction, src, dst) -> operations posted so far
    pending = [None] * pp  # rank -> set of (direction, src, dst, index) of its posted batch
    while any(pc[r] < len(progs[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            while pc[r] < len(progs[r]) and progs[r][pc[r]][0] == "compute":
                pc[r] += 1
                progress = True
            if pc[r] < len(progs[r]) and pending[r] is None:
                pending[r] = set()
                for a in progs[r][pc[r]][1]:
                    peer, _ = _message(pp, r, a)
                    key = ("send", r, peer) if a.kind.is_send else ("recv", peer, r)
                    pending[r].add((*key, count[key]))
                    count[key] += 1
                progress = True
        live = {r for r in range(pp) if pending[r] is not None}
        while True:  # drop batches with an operation whose match is not posted in a live batch
            posted = set().union(*(pending[r] for r in live))
            stuck = {r for r in live if any(("recv" if d == "send" else "send", s, t, i) not in posted
                                            for d, s, t, i in pending[r])}
            if not stuck:
                break
            live -= stuck
        for r in live:
            pending[r] = None
            pc[r] += 1
            progress = True
        assert progress, f"deadlock under group semantics: {[progs[r][pc[r]] if pc[r] < len(progs[r]) else '-' for r in range(pp)]}"


@pytest.mark.parametrize("pp,num_chunks", [(2, 1), (4, 1), (2, 2), (4, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_batches_complete_as_nccl_groups(pp, num_chunks, forward_only):
    for num_microbatches in range(1, 9):
        if num_chunks > 1 and num_microbatches % pp:
            continue
        execute_grouped(pp, num_microbatches, num_chunks, forward_only)


def _check_rank(plan, pp, rank, num_microbatches, num_chunks, forward_only):
    computes = [a for a in plan if a.kind.is_compute]
    fwd = [(a.microbatch, a.chunk) for a in computes if a.kind is K.FORWARD]
    bwd = [(a.microbatch, a.chunk) for a in computes if a.kind is K.BACKWARD]
    everything = sorted((m, c) for m in range(num_microbatches) for c in range(num_chunks))
    assert sorted(fwd) == everything
    assert sorted(bwd) == ([] if forward_only else everything)
    for mb_chunk in bwd:  # forward precedes backward
        assert fwd.index(mb_chunk) < len(computes) and computes.index(Action(K.FORWARD, *mb_chunk)) < \
            computes.index(Action(K.BACKWARD, *mb_chunk))
    for c in range(num_chunks):  # each chunk's data iterator is consumed in microbatch order
        assert [m for m, cc in fwd if cc == c] == list(range(num_microbatches))
    # microbatches in flight (forward done, backward not yet)
    in_flight, peak = 0, 0
    for a in computes:
        in_flight += 1 if a.kind is K.FORWARD else -1
        peak = max(peak, in_flight)
    return peak


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("num_microbatches", range(1, 9))
@pytest.mark.parametrize("pp", [2, 4])
def test_one_f_one_b(pp, num_microbatches, forward_only):
    plans = execute_all(pp, num_microbatches, 1, forward_only)
    for rank, plan in enumerate(plans):
        assert plan == one_f_one_b_schedule(pp, rank, num_microbatches, forward_only=forward_only)
        peak = _check_rank(plan, pp, rank, num_microbatches, 1, forward_only)
        warmup = min(pp - rank - 1, num_microbatches)
        assert num_warmup_microbatches(pp, rank, num_microbatches) == warmup
        if not forward_only:
            assert peak <= pp - rank and peak == min(warmup + 1, num_microbatches)
            computes = [a.kind for a in plan if a.kind.is_compute]
            # warmup forwards, then strictly alternating F/B, then cooldown backwards
            steady = num_microbatches - warmup
            assert computes == [K.FORWARD] * warmup + [K.FORWARD, K.BACKWARD] * steady + [K.BACKWARD] * warmup
    if not forward_only:
        assert _check_rank(plans[0], pp, 0, num_microbatches, 1, False) <= pp  # stage 0 holds at most pp


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("pp,num_microbatches,num_chunks", [
    (2, 2, 2), (2, 4, 2), (2, 6, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (2, 4, 3), (4, 8, 3), (3, 6, 2),
])
def test_interleaved(pp, num_microbatches, num_chunks, forward_only):
    plans = execute_all(pp, num_microbatches, num_chunks, forward_only)
    total = num_microbatches * num_chunks
    for rank, plan in enumerate(plans):
        assert plan == interleaved_schedule(pp, rank, num_microbatches, num_chunks, forward_only)
        peak = _check_rank(plan, pp, rank, num_microbatches, num_chunks, forward_only)
        warmup = num_warmup_microbatches(pp, rank, num_microbatches, num_chunks)
        assert warmup == min(2 * (pp - rank - 1) + (num_chunks - 1) * pp, total)
        if not forward_only:
            assert peak == min(warmup + 1, total)
            # chunk order: a group of pp microbatches passes chunk 0, 1, ... forward and the reverse backward
            fwd = [a for a in compute_order(pp, rank, num_microbatches, num_chunks) if a.kind is K.FORWARD]
            assert [a.chunk for a in fwd[: pp * num_chunks]] == [c for c in range(num_chunks) for _ in range(pp)]
            bwd = [a for a in plan if a.kind is K.BACKWARD]
            assert [a.chunk for a in bwd[:pp]] == [num_chunks - 1] * pp


def test_wraparound_messages_interleaved():
    """The last rank's chunk-0 output feeds chunk 1 of rank 0, and rank 0's chunk-1 input grad goes back."""
    plan0 = build_schedule(2, 0, 2, 2)
    plan1 = build_schedule(2, 1, 2, 2)
    assert Action(K.SEND_FORWARD, 0, 0) in plan1 and Action(K.RECV_FORWARD, 0, 1) in plan0
    assert Action(K.SEND_BACKWARD, 0, 1) in plan0 and Action(K.RECV_BACKWARD, 0, 0) in plan1
    assert Action(K.SEND_FORWARD, 0, 1) not in plan1  # the very last stage sends nothing forward
    assert not any(a.kind is K.SEND_BACKWARD and a.chunk == 0 for a in plan0)  # nor the first backward


@pytest.mark.parametrize("pp,num_microbatches,num_chunks", [(2, 1, 2), (4, 1, 2), (2, 3, 2), (3, 4, 3)])
def test_forward_only_interleaved_takes_any_microbatch_count(pp, num_microbatches, num_chunks):
    """One batch through virtual stages (generation, zero-shot scoring): each microbatch goes through every chunk
    before the next; the run completes under NCCL's group semantics, every input consumed once."""
    plans = execute_all(pp, num_microbatches, num_chunks, True)
    for rank, plan in enumerate(plans):
        _check_rank(plan, pp, rank, num_microbatches, num_chunks, True)
        fwd = [(a.microbatch, a.chunk) for a in plan if a.kind is K.FORWARD]
        assert fwd == sorted(fwd)
    execute_grouped(pp, num_microbatches, num_chunks, True)
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size"):  # training keeps the rule
        build_schedule(pp, 0, num_microbatches, num_chunks)


def test_checked_constraints():
    with pytest.raises(ValueError, match=r"multiple of --pipeline-model-parallel-size \(4\)"):
        build_schedule(4, 0, 6, 2)
    with pytest.raises(ValueError, match="needs --pipeline-model-parallel-size >= 2"):
        build_schedule(1, 0, 4, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        build_schedule(2, 0, 0, 1)
    with pytest.raises(ValueError, match="pipeline rank 2"):
        build_schedule(2, 2, 4, 1)
    with pytest.raises(ValueError, match="at least 2 model chunks"):
        interleaved_schedule(2, 0, 4, 1)
    with pytest.raises(ValueError, match="one model chunk"):
        one_f_one_b_schedule(2, 0, 4, 2)
