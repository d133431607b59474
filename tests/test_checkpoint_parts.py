"""server/checkpoint.py's composition of the parts' state_dicts by name (no server, no run):
each part gets back its own, in order, and a part the checkpoint has no state for keeps its
fresh one."""

from __future__ import annotations

from typing import Any

from server.checkpoint import Part, compose, restore


class _Counter:
    def __init__(self, log: list[str], name: str) -> None:
        self.n, self.log, self.name = 0, log, name

    def state_dict(self) -> dict[str, Any] | None:
        return {"n": self.n} if self.n else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log.append(self.name)
        self.n = int(state["n"])


def test_each_part_gets_its_own_back_in_order_and_an_empty_one_stays_fresh():
    log: list[str] = []
    a, b, c = _Counter(log, "a"), _Counter(log, "b"), _Counter(log, "c")
    a.n, c.n = 3, 7
    saved = compose({"a": a, "b": b, "c": c})
    assert saved == {"a": {"n": 3}, "b": None, "c": {"n": 7}}
    fresh = {"c": _Counter(log, "c"), "a": _Counter(log, "a"), "b": _Counter(log, "b")}
    restore(fresh, saved)
    assert [fresh[k].n for k in ("a", "b", "c")] == [3, 0, 7]
    assert log == ["c", "a"]  # the parts' order, not the checkpoint's; b had nothing


def test_a_part_absent_from_an_older_checkpoint_keeps_its_fresh_state():
    log: list[str] = []
    new_part = _Counter(log, "new")
    restore({"new": new_part}, {"old": {"n": 1}})
    assert new_part.n == 0 and log == []


def test_a_part_read_through_callables():
    held = {"v": 1}
    part = Part(lambda: dict(held), lambda s: held.update(s))
    assert compose({"p": part}) == {"p": {"v": 1}}
    restore({"p": part}, {"p": {"v": 5}})
    assert held == {"v": 5}
