"""How many Ray Serve replicas are ready, said exactly: "1 of 2 replicas ready" until the rest are.

`serve.run` returns once the Serve controller marks every replica RUNNING, but that is the controller's view:
the proxy learns its replica set on its own, later, and routes only to the replicas it knows. A server that
logged "ready (2 replicas)" at that moment could, on a busy machine, send a burst of requests all to one replica
while the other sat unused. So the driver no longer trusts that one moment:

- `ReadinessWatch` (the driver, `serving/ray_serve.py`'s `run`) deploys without blocking, then, every second,
  asks the controller which replicas are RUNNING and how many the deployment wants, and counts a replica ready
  only once a request sent through the proxy came back from it (each answer names its replica in
  `x-peregrine-replica`). It logs "Peregrine on Ray Serve at URL: N of M replicas ready" at the first ready
  replica and again at every change (the rest arriving, a replica replaced, autoscaling), for as long as it serves.
- Each replica's `GET /health` says `replicas_ready: "N of M replicas ready"` from the controller's view
  (`ReplicaMiddleware`), so a probe sees "1 of 2" for as long as one of two is not running.

Nothing here imports the app: readiness is counted from plain dicts, so the tests drive it without a cluster.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("peregrine.ray")

POLL_S = 1.0
PROBE_TIMEOUT_S = 5.0
PROBE_PATH = "/health/engine"  # cheap, open without an API key, answered by one replica


@dataclass(frozen=True)
class Readiness:
    """`ready` replicas of the `wanted` ones (the deployment's target; autoscaling moves it)."""

    ready: int
    wanted: int

    @property
    def complete(self) -> bool:
        return self.wanted > 0 and self.ready >= self.wanted

    def text(self) -> str:
        return f"{self.ready} of {self.wanted} replicas ready"


@dataclass(frozen=True)
class DeploymentView:
    """The controller's view of the deployment: app status (and its message), target count, replicas."""

    status: str | None
    message: str
    wanted: int
    replicas: list[dict[str, Any]]  # {"id", "state", ...} as `serving.ray_serve.list_replicas` gives them

    @property
    def running(self) -> set[str]:
        return {r["id"] for r in self.replicas if r.get("state") == "RUNNING"}

    @property
    def failed(self) -> bool:
        return self.status == "DEPLOY_FAILED"


def readiness(view: DeploymentView, routed: set[str] | None = None) -> Readiness:
    """Replicas RUNNING (and, when `routed` is given, also answered through the proxy) of those wanted."""
    running = view.running if routed is None else view.running & routed
    return Readiness(len(running), view.wanted)


def probe_url(host: str, port: int, root_path: str = "") -> str:
    """Where the driver reaches its own proxy: loopback when the proxy listens on every address."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{root_path.rstrip('/')}{PROBE_PATH}"


def probe_replica(url: str, header: str) -> str | None:
    """The replica that answered one request through the proxy, or None (no answer yet, proxy not up)."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            return response.headers.get(header)
    except (OSError, http.client.HTTPException):  # URLError, HTTPError (503 while nothing routes), timeouts
        return None


class ReadinessWatch:
    """The driver's watch over its replicas (module docstring). `view` reads the controller (None when it does
    not answer), `probe` sends one request through the proxy and says which replica answered."""

    def __init__(self, view: Callable[[], DeploymentView | None], probe: Callable[[], str | None],
                 announce: Callable[[Readiness], None]) -> None:
        self.view = view
        self.probe = probe
        self.announce = announce
        self.routed: set[str] = set()
        self.last: Readiness | None = None
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> DeploymentView | None:
        """One look: the controller's view, probes for RUNNING replicas the proxy has not answered from yet,
        and an announcement if the count changed. Returns the view (None: the controller did not answer)."""
        view = self.view()
        if view is None:
            return None
        self.routed &= view.running  # a replaced replica must be routed to again
        missing = view.running - self.routed
        for _ in range(4 * len(missing)):  # the proxy picks the replica: a few tries find each idle one
            replica = self.probe()
            if replica is not None:
                self.routed.add(replica)
            if view.running <= self.routed:
                break
        now = readiness(view, self.routed)
        if now != self.last and (now.ready > 0 or self.last is not None):  # from the first ready one on
            self.last = now
            self.announce(now)
        return view

    def wait_first(self) -> DeploymentView | None:
        """Block until a replica is ready (its view) or the deployment failed (that view); None if stopped."""
        while not self.stop.is_set():
            view = self.tick()
            if view is not None and (view.failed or self.last is not None):
                return view
            self.stop.wait(POLL_S)
        return None

    def keep_watching(self) -> None:
        """Go on announcing every change, in a daemon thread, until `close`."""
        self._thread = threading.Thread(target=self._loop, name="peregrine-ray-readiness", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.tick()
            except Exception as exc:  # the watch must never take the server down
                log.warning("could not check the replicas: %s", exc)

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_S + POLL_S)
