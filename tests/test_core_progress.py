"""fedasync.progress: plain lines every few percent off a terminal, the caller's bar on one."""

import io

import pytest

from fedasync.progress import MAX_POSTFIX, LineProgress, NoProgress, progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_two_hundred_updates_write_a_line_per_five_percent_and_a_final_one():
    # Prepare
    stream = io.StringIO()

    # Execute
    with progress(200, "train", stream=stream, unit="step") as bar:
        for _ in range(200):
            bar.update()
            bar.set_postfix(loss=0.43, refresh=False)

    # Assert
    text = stream.getvalue()
    lines = text.splitlines()
    assert isinstance(bar, LineProgress)
    assert "\r" not in text
    assert len(lines) == 21  # 5%, 10%, ..., 100%, and the close
    assert lines[0].startswith("train: 5% (10/200 step)")
    assert lines[7].startswith("train: 40% (80/200 step)")
    assert "loss=0.43" in lines[7] and "elapsed" in lines[7] and "left" in lines[7]
    assert lines[-1].startswith("train: 100% (200/200 step) done in")


def test_close_writes_once_and_says_where_progress_stopped():
    # Prepare
    stream = io.StringIO()
    bar = progress(100, "runs", stream=stream)

    # Execute
    bar.update(3)
    bar.close()
    bar.close()
    bar.update(50)  # after close: nothing

    # Assert
    assert stream.getvalue().splitlines() == [stream.getvalue().splitlines()[0]]
    assert stream.getvalue().startswith("runs: 3% (3/100) done in")


def test_postfix_is_one_bounded_line():
    # Prepare
    stream = io.StringIO()
    bar = progress(10, "x", stream=stream)

    # Execute
    bar.set_postfix_str("a\r\nb" + "z" * 1000)
    bar.update(10)

    # Assert
    line = stream.getvalue().splitlines()[0]
    assert "\r" not in stream.getvalue() and len(stream.getvalue().splitlines()) == 1
    assert bar.postfix.startswith("a  b") and len(bar.postfix) == MAX_POSTFIX
    assert len(line) < MAX_POSTFIX + 100


def test_a_disabled_progress_writes_nothing():
    # Prepare
    stream = TtyStream()

    # Execute
    with progress(10, "x", stream=stream, tty_bar=lambda **kw: pytest.fail(), disable=True) as b:
        b.update(5)
        b.n = 10
        b.set_postfix(loss=1.0)
        b.set_postfix_str("s")
        b.set_description("d")
        b.refresh()

    # Assert
    assert isinstance(b, NoProgress)
    assert stream.getvalue() == ""


def test_a_terminal_gets_the_tty_bar_factorys_object():
    # Prepare
    stream = TtyStream()
    made: list[dict] = []

    def factory(**kw):
        made.append(kw)
        return "the bar"

    # Execute
    bar = progress(7, "d", stream=stream, tty_bar=factory, unit="s", initial=2, leave=False)
    plain = progress(7, "d", stream=stream)  # a terminal but no factory: lines

    # Assert
    assert bar == "the bar"
    assert made == [dict(total=7, desc="d", file=stream, unit="s", initial=2, leave=False)]
    assert isinstance(plain, LineProgress)


def test_a_non_terminal_ignores_the_factory():
    stream = io.StringIO()

    bar = progress(7, "d", stream=stream, tty_bar=lambda **kw: pytest.fail(), leave=False)

    assert isinstance(bar, LineProgress)


def test_setting_n_crosses_thresholds_once_each_and_resumes_silently():
    # Prepare: resumed at 30 of 300 (10%), lines every 25%
    stream = io.StringIO()
    bar = LineProgress(300, "srv", stream=stream, every=0.25, initial=30)

    # Execute
    bar.n = 60.5
    bar.refresh()
    bar.n = 80.0  # 26.7%: crosses 25%
    bar.n = 90.0
    bar.n = 300.0  # jumps past 50% and 75% to 100%: one line
    bar.refresh()

    # Assert
    lines = stream.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["srv: 27%", "srv: 100%"]
    assert "(80/300)" in lines[0]


def test_no_total_writes_a_line_every_every_s_seconds():
    # Prepare
    stream = io.StringIO()
    clock = FakeClock()
    bar = LineProgress(None, "stream", stream=stream, every_s=30, unit="tok", clock=clock)

    # Execute
    for t in range(0, 100):
        clock.t = float(t)
        bar.update(2)
    bar.close()

    # Assert: at 30, 60 and 90 s, and the close
    lines = stream.getvalue().splitlines()
    assert lines == [
        "stream: 62 tok, 30 s elapsed",
        "stream: 122 tok, 1m00s elapsed",
        "stream: 182 tok, 1m30s elapsed",
        "stream: 200 tok, done in 1m39s",
    ]


def test_time_left_follows_the_rate():
    stream = io.StringIO()
    clock = FakeClock()
    bar = LineProgress(200, "train", stream=stream, every=0.2, clock=clock)

    clock.t = 12.0
    bar.n = 80  # 40% in 12 s: 120 more take 18 s

    assert stream.getvalue() == "train: 40% (80/200) 12 s elapsed, ~18 s left\n"
