"""Ray Serve readiness, said exactly (serving/ray_readiness.py), without a cluster: the controller's view and the
proxy's answers are scripted, so each case is the state it names. The end-to-end counterpart, on a real local
cluster, is in tests/ray/test_ray_serve.py (`test_one_of_two_replicas_says_so`, and the fixture's wait)."""

from __future__ import annotations

import itertools

from serving.ray_readiness import DeploymentView, Readiness, ReadinessWatch, probe_url, readiness


def view(states: dict[str, str], wanted: int, status: str = "DEPLOYING") -> DeploymentView:
    return DeploymentView(status, "", wanted, [{"id": rid, "state": state} for rid, state in states.items()])


class Script:
    """The controller's successive views and the replicas the proxy answers from, in turn."""

    def __init__(self, views: list[DeploymentView | None], answers: list[str | None]) -> None:
        self.views = iter(views)
        self.answers = itertools.cycle(answers)
        self.said: list[str] = []
        self.probes = 0

    def watch(self) -> ReadinessWatch:
        return ReadinessWatch(lambda: next(self.views), self.probe, lambda now: self.said.append(now.text()))

    def probe(self) -> str | None:
        self.probes += 1
        return next(self.answers)


def test_readiness_counts_running_replicas_of_the_target() -> None:
    both = view({"a": "RUNNING", "b": "RUNNING"}, 2)
    one = view({"a": "RUNNING", "b": "PENDING_ALLOCATION"}, 2)
    assert readiness(both) == Readiness(2, 2) and readiness(both).complete
    assert readiness(one).text() == "1 of 2 replicas ready" and not readiness(one).complete
    assert readiness(both, routed={"a"}) == Readiness(1, 2)  # RUNNING, but the proxy never answered from b
    assert not Readiness(0, 0).complete


def test_running_is_not_ready_until_the_proxy_answers_from_it() -> None:
    """The defect: the controller says both RUNNING while the proxy routes to one. Not "2 of 2" then."""
    both = view({"a": "RUNNING", "b": "RUNNING"}, 2)
    script = Script([both, both, both], ["a", "a", "a", "a", "a", "a", "a", "a", "b"])
    watch = script.watch()
    watch.tick()
    assert script.said == ["1 of 2 replicas ready"]
    assert script.probes == 8  # a few tries for the missing one, then the next second
    watch.tick()
    assert script.said == ["1 of 2 replicas ready", "2 of 2 replicas ready"]
    watch.tick()
    assert script.said == ["1 of 2 replicas ready", "2 of 2 replicas ready"]  # said once per change
    assert script.probes == 9  # nothing missing: no probe


def test_one_of_two_keeps_saying_so_until_the_second_runs() -> None:
    pending = view({"a": "RUNNING", "b": "PENDING_ALLOCATION"}, 2)
    running = view({"a": "RUNNING", "b": "RUNNING"}, 2)
    script = Script([None, pending, pending, pending, running], ["a", "b"])
    watch = script.watch()
    assert watch.tick() is None and script.said == []  # the controller did not answer: nothing is claimed
    for _ in range(3):
        watch.tick()
        assert script.said == ["1 of 2 replicas ready"]
    watch.tick()
    assert script.said == ["1 of 2 replicas ready", "2 of 2 replicas ready"]


def test_a_replaced_replica_is_ready_again_only_once_routed() -> None:
    both = view({"a": "RUNNING", "b": "RUNNING"}, 2)
    replaced = view({"a": "RUNNING", "c": "RUNNING"}, 2)
    script = Script([both, replaced, replaced], ["a", "b", *["a"] * 4, "a", "c"])  # 4 tries a second
    watch = script.watch()
    watch.tick()
    watch.tick()
    watch.tick()
    assert script.said == ["2 of 2 replicas ready", "1 of 2 replicas ready", "2 of 2 replicas ready"]


def test_losing_every_replica_is_said_too() -> None:
    one = view({"a": "RUNNING"}, 1)
    gone = view({"b": "STARTING"}, 1)
    script = Script([gone, one, gone], ["a"])
    watch = script.watch()
    for _ in range(3):
        watch.tick()
    assert script.said == ["1 of 1 replicas ready", "0 of 1 replicas ready"]  # nothing before the first


def test_wait_first_returns_at_the_first_ready_replica_or_a_failed_deploy() -> None:
    starting = view({"a": "STARTING", "b": "STARTING"}, 2)
    one = view({"a": "RUNNING", "b": "STARTING"}, 2)
    script = Script([starting, one], ["a"])
    watch = script.watch()
    watch.stop.wait = lambda _timeout: False  # no real second between looks
    assert watch.wait_first() is one and script.said == ["1 of 2 replicas ready"]
    failed = Script([starting, view({}, 2, status="DEPLOY_FAILED")], [None])
    watch = failed.watch()
    watch.stop.wait = lambda _timeout: False
    assert watch.wait_first().failed and failed.said == []


def test_probe_goes_to_our_own_proxy() -> None:
    assert probe_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/health/engine"
    assert probe_url("127.0.0.1", 9001, "/llm/") == "http://127.0.0.1:9001/llm/health/engine"
    assert probe_url("::", 8000) == "http://[::1]:8000/health/engine"
