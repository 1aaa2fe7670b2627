#!/usr/bin/env python3
"""What routing policy can reach at best: a discrete-event model of the routing benchmark.

    python bench/routing_model.py [--instances 4] [--requests 60000]

A model, not a measurement: Poisson arrivals, N instances that each serve one request
at a time in arrival order, service times of bench/run.py's mix (80 % 40 ms, 20 % 400 ms),
no network and no balancer cost. It answers "how far can a policy go on this mix?":

  round-robin          the seeds' nginx
  least-connections    nginx least_conn (--routing least-conn), ideal: exact counts
  work                 cosyvoice-lb's --routing work: nginx tries instances by least
                       connections; one declines when an instance not tried yet would start
                       the request more than SLACK sooner (each decline costs HOP)
  least-work-left      the instance whose queued work ends first (as good as one shared
                       queue): what a balancer that knew each request's cost would do

It prints p50/p95/p99 per policy and load, and the p99 ratios against round-robin.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cosyvoice_lb.instance.routing.rule import DEFAULT_SLACK, Backlog, Peer, decide  # noqa: E402  (what an instance decides)

SHORT, LONG, LONG_SHARE = 0.040, 0.400, 0.2
MEAN = (1 - LONG_SHARE) * SHORT + LONG_SHARE * LONG
SLACK = DEFAULT_SLACK  # --route-slack's default
HOP = 0.002  # a decline and nginx's next try, as measured on 127.0.0.1
POLICIES = ("round-robin", "least-connections", "work", "least-work-left")


def simulate(policy: str, load: float, instances: int, requests: int, seed: int = 1) -> np.ndarray:
    """Latencies (ms) of ``requests`` arrivals at ``load`` x capacity under ``policy``."""
    rng = random.Random(seed)
    ties = random.Random(seed + 1)  # (its own stream: every policy sees the same arrivals)
    rate = load * instances / MEAN
    free_at = [0.0] * instances  # when each instance finishes what it has been given
    queued: list[deque] = [deque() for _ in range(instances)]  # finish times of its outstanding requests
    latencies = np.empty(requests)
    now, turn = 0.0, 0
    for i in range(requests):
        now += rng.expovariate(rate)
        service = LONG if rng.random() < LONG_SHARE else SHORT
        for q in queued:
            while q and q[0] <= now:
                q.popleft()
        tried: list[int] = []  # instances that declined this request (routing by work)
        if policy == "round-robin":
            k, turn = turn, (turn + 1) % instances
        elif policy == "least-connections":  # ties broken at random
            k = min(range(instances), key=lambda j: (len(queued[j]), ties.random()))
        elif policy == "work":  # nginx tries by least connections; each instance decides as an instance does
            while True:
                k = min((j for j in range(instances) if j not in tried), key=lambda j: (len(queued[j]), ties.random()))
                peers = [Peer(j, Backlog(free_at[j]), declined=j in tried) for j in range(instances) if j != k]
                if not decide(Backlog(free_at[k]), peers, now, SLACK).decline:
                    break
                tried.append(k)  # declined: nginx tries the next by least connections
        elif policy == "least-work-left":
            k = min(range(instances), key=lambda j: max(free_at[j], now))
        else:
            raise ValueError(policy)
        free_at[k] = max(free_at[k], now + HOP * len(tried)) + service
        queued[k].append(free_at[k])
        latencies[i] = (free_at[k] - now) * 1000
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60000)
    args = parser.parse_args()
    print(f"command: python bench/routing_model.py --instances {args.instances} --requests {args.requests}")
    print("| load % | policy | p50 ms | p95 ms | p99 ms | p99 vs round-robin |")
    print("|---|---|---|---|---|---|")
    for load in (0.5, 0.7, 0.9):
        p99s = {}
        for policy in POLICIES:
            p50, p95, p99 = np.percentile(simulate(policy, load, args.instances, args.requests), [50, 95, 99])
            p99s[policy] = p99
            print(f"| {load:.0%} | {policy} | {p50:.0f} | {p95:.0f} | {p99:.0f} | {p99 / p99s['round-robin']:.2f} |")


if __name__ == "__main__":
    main()
