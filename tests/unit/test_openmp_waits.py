"""main.quiet_openmp_waits: OpenMP workers spin briefly, then sleep, unless the user set either variable."""

from __future__ import annotations

import os

import pytest

import main


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    return monkeypatch


def test_unset_gives_passive_with_a_short_spin(clean_env: pytest.MonkeyPatch) -> None:
    main.quiet_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == main.OPENMP_SPINS == "1000"


@pytest.mark.parametrize(("name", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000")])
def test_a_users_choice_is_left_alone(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    clean_env.setenv(name, value)
    main.quiet_openmp_waits()
    assert os.environ[name] == value
    other = "GOMP_SPINCOUNT" if name == "OMP_WAIT_POLICY" else "OMP_WAIT_POLICY"
    assert other not in os.environ  # neither filled in: a user's ACTIVE keeps libgomp's own spin count
