"""The example Scheduler subclass (examples/shortest_prompt_first.py) on the fake model
worker: it admits the shortest waiting prompt first where the default Scheduler admits in
arrival order. (tests/e2e/test_extending.py runs the same class in a server's Scheduler
process, named by --scheduler-class.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from framework.runtime.scheduler import Scheduler
from tests.fake_worker import SchedulerHarness, prompt

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: Queued behind a running request, in this order of arrival.
QUEUED = {"long": 60, "medium": 20, "short": 1}


def first_output_order(scheduler_class: type) -> list[str]:
    """Run a request, queue three prompts behind it (one running request at most), and
    list the requests in the order of their first outputs."""
    h = SchedulerHarness(scheduler_class=scheduler_class, max_running_requests=1)
    try:
        h.submit("blocker", prompt(0, 4), max_new_tokens=6, ignore_eos=True)
        h.step()
        for seed, (name, length) in enumerate(QUEUED.items(), start=1):
            h.submit(name, prompt(seed, length), max_new_tokens=2, ignore_eos=True)
        order: list[str] = ["blocker"]
        for _ in range(200):
            h.step()
            order += [rid for rid, outcome in h.outcomes.items()
                      if outcome.messages and rid not in order]
            if len(order) == 1 + len(QUEUED) and h.scheduler.in_flight is None:
                break
        h.run()
        h.assert_idle_invariant()
        return order
    finally:
        h.close()


@pytest.fixture
def shortest_prompt_first(monkeypatch: pytest.MonkeyPatch) -> type:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    module = __import__("shortest_prompt_first")
    monkeypatch.delitem(sys.modules, "shortest_prompt_first")
    return module.ShortestPromptFirstScheduler


def test_the_default_scheduler_admits_in_arrival_order() -> None:
    assert first_output_order(Scheduler) == ["blocker", "long", "medium", "short"]


def test_the_example_subclass_admits_the_shortest_prompt_first(
        shortest_prompt_first: type) -> None:
    assert first_output_order(shortest_prompt_first) == ["blocker", "short", "medium", "long"]
