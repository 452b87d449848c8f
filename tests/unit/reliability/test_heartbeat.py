"""The heartbeats that name a frozen rank: three gloo processes, one stops beating (as a SIGSTOPped process
does); the two others, checking at the same moment, each name it, and not each other."""

import os
import re
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from megatron.training.watchdog import _PREFIX, Heartbeat, describe_timeout
from tests.dist_utils import run_distributed


def _body(rank, world_size):
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    reports = []
    beat = Heartbeat(interval=0.2, timeout_minutes=0.05, report_stalls=(rank != 1), on_stall=reports.append)
    beat.iteration = 7
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        mine = dist.PrefixStore(_PREFIX, store)
        while not mine.get("rank/1/beat").decode().endswith(" 7"):
            time.sleep(0.05)  # the thread has published iteration 7
        beat.stop()  # frozen: its counter stops; it waits (without collectives) until the others have looked
        dist.barrier()
        store.wait(["checked/0", "checked/2"], timedelta(seconds=120))
    else:
        dist.barrier()
        deadline = time.time() + 60
        while not reports and time.time() < deadline:  # the thread reports after 0.8 x 3 s without progress
            time.sleep(0.1)
        line = describe_timeout(rank, "Timed out waiting 3000ms for recv operation to complete")
        store.set(f"checked/{rank}", "1")
        named = (rf"rank 1 \(host {re.escape(socket.gethostname())}, pid {pids[1]}, last at iteration 7\) has "
                 r"stopped responding \(no heartbeat for [0-9.]+ s\); ")
        assert len(reports) == 1, reports
        assert re.fullmatch(named + rf"rank {rank} has made no progress for \d+ s \(the job ends at "
                            r"--distributed-timeout-minutes 0.05\)", reports[0]), reports
        assert re.fullmatch(named + rf"rank {rank} waited in a collective longer than "
                            r"--distributed-timeout-minutes 0.05", line), line
    dist.barrier()
    beat.stop()


def test_two_waiting_ranks_each_name_the_frozen_one():
    run_distributed(_body, world_size=3)
