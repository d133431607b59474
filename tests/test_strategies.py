"""The strategies (server/strategies.py): each ``server.mode`` is one class, its fold rule and
what it sends when; the loop and its parts never ask which one runs."""

import re
from pathlib import Path

import pytest

from fedasync import FedAsyncAggregator, FedBuffAggregator
from server.config import MODES
from server.strategies import STRATEGIES, FedAsync, FedBuff, SyncFedAvg, strategy_for

ROOT = Path(__file__).resolve().parent.parent


class _Host:
    """A loop as a strategy sees it: what it was asked, in order."""

    def __init__(self, inflight=()):
        self.roster = {2: 12, 0: 10, 1: 11}
        self.inflight = {f"m{i}": i for i in inflight}
        self.asked: list[tuple] = []

    def dispatch(self, silo):
        self.asked.append(("dispatch", silo))

    def retry_after(self, silo, down_s):
        self.asked.append(("retry_after", silo, down_s))

    def flush(self):
        self.asked.append(("flush",))


def test_every_mode_is_a_strategy_of_that_name(small_cfg):
    assert sorted(STRATEGIES) == sorted(MODES)
    for mode, cls in STRATEGIES.items():
        s = strategy_for(small_cfg(f"server.mode={mode}"))
        assert type(s) is cls and s.name == mode


def test_each_strategy_folds_with_its_own_rule(small_cfg):
    fa = strategy_for(small_cfg("server.alpha=0.3")).aggregator()
    assert isinstance(fa, FedAsyncAggregator) and fa.alpha == 0.3
    fb = strategy_for(small_cfg("server.mode=fedbuff", "server.buffer_size=4")).aggregator()
    assert isinstance(fb, FedBuffAggregator) and fb.buffer_size == 4
    cfg = small_cfg("server.mode=sync")
    sync = strategy_for(cfg).aggregator()
    assert isinstance(sync, FedBuffAggregator) and sync.buffer_size == cfg.silos.count
    assert sync.weight_fn(7) == sync.weight_fn(0) == 1.0  # a round's updates weigh alike


@pytest.mark.parametrize("cls", [FedAsync, FedBuff])
def test_an_asynchronous_strategy_sends_every_free_silo_work_at_once(cls, small_cfg):
    s = cls(small_cfg("server.eval_every=5"))
    host = _Host(inflight=[0])
    s.replies_taken(host, [2, 1])
    s.failed(host, 1, 20.0)
    s.free(host, 0)
    assert host.asked == [("dispatch", 1), ("dispatch", 2), ("retry_after", 1, 20.0)] + [
        ("dispatch", 0)
    ]
    assert [v for v in range(1, 16) if s.evaluates(v)] == [5, 10, 15]


def test_synchronous_fedavg_waits_for_the_round_then_sends_everyone_the_new_model(small_cfg):
    s = SyncFedAvg(small_cfg("server.mode=sync", "server.eval_every=5"))
    busy = _Host(inflight=[0])
    s.replies_taken(busy, [1, 2])  # a reply is still out: the round goes on
    s.failed(busy, 1, 20.0)  # it rejoins at the next round
    s.free(busy, 2)
    assert busy.asked == []
    done = _Host()
    s.replies_taken(done, [])
    assert done.asked == [("flush",), ("dispatch", 0), ("dispatch", 1), ("dispatch", 2)]
    assert all(s.evaluates(v) for v in range(1, 7))  # every round


def test_the_loop_and_its_parts_never_ask_which_mode_runs():
    # the strategy decides; a part reading server.mode (or a flag made from it) would be a
    # special case again. Allowed: the strategies, the config, and where the mode is a value
    # the run records (summary, bundle, events, the checkpoint's check)
    allowed = {"config.py", "summary.py", "bundle.py", "checkpoint.py"}
    asks = re.compile(r"mode\s*[!=]=|mode\s+(not\s+)?in\b|\.barrier\b")
    found = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        if path.name in allowed or path.parent.name == "strategies":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if asks.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == [], found
