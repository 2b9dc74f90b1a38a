"""Pacing in a co-run: a virtual rank that another member runs for real keeps to that real rank.

In a co-run (`slices.run_together`) each member's assistant hosts, among its virtual ranks,
ranks that another member runs for real. Left alone, such a virtual rank answers at once and
each member's real ranks go at their own pace, out of step with the real ranks beside them (in
tensor parallelism a rank computed beside its neighbour's compute 55% of the time instead of
90%, and computed faster for it). Paced, the virtual rank's gloo op goes on the wire only once
its real counterpart has issued the same node: a member's real rank then waits in a collective
until the real rank of the other member arrives, as in the full job, and the members run in
step. The virtual rank still issues at once and its op is made ready (tensors in hand) ahead;
only the hand-over to gloo waits, on a pool thread.

The real rank publishes the nodes it has issued in its flight record (`trace/flight.py`, one
store per op) and nudges the pacing members' assistants over a datagram socket in Linux's
abstract namespace; a nudge lost (the assistant not yet listening) is made good by every
waiting op re-reading the record each `POLL_S`.

The same wait serves a plain slice whose virtual members of collectives join late
(`slices.run_with_assistant(join_late=True)`): each goes on the wire once a sandbox member of
the op has issued it, keyed by that member's own flight record.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ENV_NUDGE = "PRISM_PACE_NUDGE"     # comma-separated abstract socket names a real rank nudges on each op
POLL_S = 0.02


def socket_name(directory: Path) -> str:
    """The abstract socket name of the assistant of the run in `directory`, unique to this process."""
    digest = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return f"prism-pace-{os.getpid()}-{digest}"


@dataclass
class Pacing:
    """One co-run member's pacing: its virtual ranks that other members run for real, with those
    ranks' flight records (`counterparts`); its assistant's socket; the sockets its own ranks
    nudge."""
    counterparts: dict[int, Path]
    socket: str
    nudge: list[str] = field(default_factory=list)


def co_run_pacing(members: list[tuple[list[int], Path]]) -> list[Pacing]:
    """Each member's virtual ranks keep to the first other member that runs them for real (a
    member and its twin, the same ranks again, keep to nobody)."""
    dirs = [Path(d) for _, d in members]
    out = [Pacing({}, socket_name(d)) for d in dirs]
    runs_for_real: dict[int, int] = {}
    for m, (sandbox, _) in enumerate(members):
        for r in sandbox:
            runs_for_real.setdefault(r, m)
    for n, (sandbox, _) in enumerate(members):
        for r, m in runs_for_real.items():
            if r not in sandbox and m != n:
                out[n].counterparts[r] = dirs[m] / "flight" / f"{r}.bin"
                if out[n].socket not in out[m].nudge:
                    out[m].nudge.append(out[n].socket)
    return out


class Nudger:
    """A real rank's side: nudge every pacing assistant after each op issued (best effort)."""

    def __init__(self, names: list[str]):
        self.addresses = ["\0" + n for n in names]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def nudge(self) -> None:
        for address in self.addresses:
            try:
                self.sock.sendto(b"!", address)
            except OSError:      # not listening yet, or its queue is full: it re-reads on its own
                pass

    @classmethod
    def from_env(cls) -> Nudger | None:
        names = [n for n in os.environ.get(ENV_NUDGE, "").split(",") if n]
        return cls(names) if names else None


class Pacer:
    """An assistant's side: which virtual ranks keep to a real counterpart, and the wait for it.

    `counterparts`: virtual rank -> the flight record (`flight/<rank>.bin`) of the member that
    runs it for real; `name`: the abstract socket those real ranks nudge.
    """

    def __init__(self, counterparts: dict[int, Path], name: str):
        from prism_core.trace.flight import ISSUED_FIELD

        self.counterparts = {int(r): Path(p) for r, p in counterparts.items()}
        self.field = ISSUED_FIELD
        self.maps: dict[int, np.ndarray] = {}
        self.cond = threading.Condition()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + name)
        self.sock.settimeout(POLL_S)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.deadline = float("inf")     # time.monotonic() past which a wait fails
        self.nudges = 0
        self.waits = 0                   # ops that went on the wire later than ready, waiting
        self.waited_s = 0.0

    def issued(self, rank: int) -> int:
        """Nodes the counterpart of virtual `rank` has issued (0 before its record exists)."""
        mm = self.maps.get(rank)
        if mm is None:
            path = self.counterparts[rank]
            try:
                if path.stat().st_size < (self.field + 1) * 8:
                    return 0
                mm = self.maps[rank] = np.memmap(path, dtype=np.int64, mode="r")
            except OSError:
                return 0
        return int(mm[self.field])

    def wait_for(self, rank: int, local: int) -> None:
        """Block until the counterpart of virtual `rank` has issued its node `local` (a pool thread)."""
        if self.issued(rank) > local:
            return
        began = time.perf_counter()
        with self.cond:
            while self.issued(rank) <= local:
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"rank {rank} in the co-run never issued its node {local} "
                                       f"({self.counterparts[rank]} reads {self.issued(rank)})")
                self.cond.wait(POLL_S)
            self.waits += 1
            self.waited_s += time.perf_counter() - began

    def start(self, deadline: float) -> None:
        """Listen for nudges until `close`; waits fail past `deadline` (time.monotonic())."""
        self.deadline = deadline

        def watch() -> None:
            while not self.stopping.is_set():
                try:
                    self.sock.recv(64)
                except TimeoutError:
                    continue
                except OSError:
                    return
                self.nudges += 1
                with self.cond:
                    self.cond.notify_all()

        self.thread = threading.Thread(target=watch, name="pace-watch", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * POLL_S + 1)
        self.sock.close()
