"""The gloo group of a torchelastic attempt, joined through keys that no other attempt of the job wrote.

torchrun's agents give their workers one store for every round of a job (the static rendezvous's, and the store the
c10d rendezvous shares across rounds), while torch's env:// join reads it without a prefix ("a new TCPStore for every
retry"; it is not). A restarted rank could then read a dead rank's address and hang in gloo's connect, or fail with
"Connection refused": seen in about half of the restarts on this CPU, with accelerate launch and with torchrun.

The attempt's key cannot be TORCHELASTIC_RESTART_COUNT either: that is each agent's own count, and the counts differ
between nodes after a membership change (membership changes are not counted as restarts, and the agent of a node that
joined later starts from 0), so ranks keyed by it never meet. The ranks agree on a key instead: each says hello under
a fresh nonce; rank 0 answers every hello it reads with its own fresh nonce until every rank has confirmed under that
nonce. A hello or an answer left by an earlier attempt is never waited for, so it cannot mislead anyone.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch

from ..errors import LaunchError

ROOT = "accel_train"


def reuses_agent_store() -> bool:
    """True where torchelastic's agent gives every attempt the same store (its TORCHELASTIC_USE_AGENT_STORE)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def join_attempt_group(timeout: int) -> str:
    """Initialise this process's gloo group under a prefix every rank of this attempt agreed on; the prefix."""
    wait = datetime.timedelta(seconds=timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                       is_master=False, timeout=wait)
    nonce = lead_attempt(store, world, timeout) if rank == 0 else follow_attempt(store, rank)
    prefix = f"{ROOT}/{nonce}"
    torch.distributed.init_process_group("gloo", store=torch.distributed.PrefixStore(prefix, store), rank=rank,
                                         world_size=world, timeout=wait)
    return prefix


def follow_attempt(store, rank: int) -> str:
    """Rank > 0: say hello under a nonce of this process, wait for rank 0's answer, confirm under it."""
    hello = uuid.uuid4().hex
    store.set(f"{ROOT}/hello/{rank}", hello)
    lead = store.get(f"{ROOT}/ack/{hello}").decode()  # waits up to the store's timeout
    store.set(f"{ROOT}/done/{lead}/{rank}", "1")
    return lead


def lead_attempt(store, world: int, timeout: float, poll: float = 0.01) -> str:
    """Rank 0: answer every rank's current hello with this attempt's nonce until each confirmed under it."""
    lead, answered = uuid.uuid4().hex, {}
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"{ROOT}/done/{lead}/{rank}"]):
                waiting.discard(rank)
            elif store.check([f"{ROOT}/hello/{rank}"]):
                hello = store.get(f"{ROOT}/hello/{rank}").decode()
                if answered.get(rank) != hello:  # a new hello (or an earlier attempt's, answered harmlessly)
                    store.set(f"{ROOT}/ack/{hello}", lead)
                    answered[rank] = hello
        if waiting and time.monotonic() > deadline:
            raise LaunchError(f"rank(s) {', '.join(map(str, sorted(waiting)))} of this attempt did not join rank 0 "
                              f"within --ddp_timeout {timeout} s: see their logs (a crash at start-up, or a node "
                              "that cannot reach MASTER_ADDR).")
        time.sleep(poll if waiting else 0)
    return lead
