"""Progress output that suits a log: a bar on a terminal, a plain line every few percent else.

Paper: none; console plumbing shared by the federated server, the trainers and the
benchmarks.

A terminal gets the usual redrawn bar (the caller passes a factory such as ``tqdm.tqdm``, so
the core need not import it). Anywhere else (CI, ``make demo > log``, a scheduler's log) a
redrawn bar writes a carriage-return frame per refresh, thousands of them into the file;
:class:`LineProgress` writes one plain line each time progress crosses another ``every``
fraction of the total, and one at :meth:`LineProgress.close`, e.g.::

    train: 40% (80/200 step) 12 s elapsed, ~18 s left, loss=0.43

Departures from tqdm: only the methods the callers use (``update``, a settable ``n``,
``set_postfix``, ``set_postfix_str``, ``set_description``, ``refresh``, ``close``, a context
manager); it does not wrap an iterable (call ``update`` in the loop); ``refresh`` never
forces a line; with no total (``None`` or 0) a line is written every ``every_s`` seconds of
progress instead; a line is cut to a bounded length, its postfix to ``MAX_POSTFIX`` chars.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

MAX_POSTFIX = 200
"""The longest postfix (``loss=0.43, ...``) a line carries; longer ones end in ``...``."""


def _duration(s: float) -> str:
    """``12 s``, ``3m05s``, ``1h02m``."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        m, sec = divmod(int(round(s)), 60)
        return f"{m}m{sec:02d}s"
    h, rest = divmod(int(round(s)), 3600)
    return f"{h}h{rest // 60:02d}m"


def _number(x: float) -> str:
    """An integer as is, any other float with one decimal."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.1f}"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _one_line(s: str) -> str:
    return s.replace("\r", " ").replace("\n", " ")


class LineProgress:
    """A tqdm-like progress object that writes plain lines to ``stream`` (default stderr).

    A line is written when ``n / total`` crosses another multiple of ``every`` (one line
    however many multiples one step crosses), and once at :meth:`close`. With ``total`` None
    or 0, a line whenever ``every_s`` seconds have passed since the last one. ``clock`` (for
    tests) returns seconds; it defaults to :func:`time.monotonic`.
    """

    def __init__(
        self,
        total: float | None,
        desc: str = "",
        *,
        stream: IO[str] | None = None,
        every: float = 0.05,
        every_s: float = 30.0,
        unit: str | None = None,
        initial: float = 0,
        clock: Callable[[], float] | None = None,
    ):
        if not 0 < every <= 1:
            raise ValueError("every must be in (0, 1]")
        if not every_s > 0:
            raise ValueError("every_s must be > 0")
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.every_s = every_s
        self.unit = unit
        self.postfix = ""
        self.closed = False
        self._clock = clock if clock is not None else time.monotonic
        self._t0 = self._clock()
        self._initial = initial
        self._n = initial
        self._level = self._level_of(initial)  # the resumed-from level is not announced
        self._last_line_at = self._t0

    # ------------------------------------------------------------------ tqdm's surface
    @property
    def n(self) -> float:
        """Progress so far, in ``unit``; setting it may write a line."""
        return self._n

    @n.setter
    def n(self, value: float) -> None:
        self._n = value
        self._check()

    def update(self, n: float = 1) -> None:
        """Advance progress by ``n``; writes a line if one is due."""
        self.n = self._n + n

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None:
        """Show ``key=value`` pairs after the line (``refresh`` is accepted and ignored)."""
        items = {**(ordered_dict or {}), **kwargs}
        self.set_postfix_str(", ".join(f"{k}={_value(v)}" for k, v in items.items()), refresh)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show ``s`` after the line, on one line and cut to ``MAX_POSTFIX`` chars."""
        s = _one_line(str(s))
        self.postfix = s if len(s) <= MAX_POSTFIX else s[: MAX_POSTFIX - 3] + "..."

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Set the line's prefix (made one line; ``None`` for none)."""
        self.desc = _one_line(desc or "")

    def refresh(self) -> None:
        """Nothing to redraw: only a line that is due (a time-based one) is written."""
        self._check()

    def close(self) -> None:
        """Write the final line (where progress stopped, and the time it took); once."""
        if self.closed:
            return
        self.closed = True
        self._write(final=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lines
    def _level_of(self, n: float) -> int:
        if not self.total:
            return 0
        return math.floor(min(n / self.total, 1.0) / self.every + 1e-9)

    def _check(self) -> None:
        if self.closed:
            return
        if self.total:
            level = self._level_of(self._n)
            if level > self._level:
                self._level = level
                self._write()
        elif self._clock() - self._last_line_at >= self.every_s:
            self._write()

    def line(self, final: bool = False) -> str:
        """The line that would be written now."""
        now = self._clock()
        elapsed = now - self._t0
        unit = f" {self.unit}" if self.unit else ""
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            pct = 100.0 * self._n / self.total
            parts = [f"{head}{pct:.0f}% ({_number(self._n)}/{_number(self.total)}{unit})"]
            timing = f"{_duration(elapsed)} elapsed"
            done = self._n - self._initial
            if final:
                timing = f"done in {_duration(elapsed)}"
            elif done > 0 and self._n < self.total:
                timing += f", ~{_duration((self.total - self._n) * elapsed / done)} left"
            parts.append(timing)
        else:
            timing = f"done in {_duration(elapsed)}" if final else f"{_duration(elapsed)} elapsed"
            parts = [f"{head}{_number(self._n)}{unit},", timing]
        text = " ".join(parts)
        if self.postfix:
            text += f", {self.postfix}"
        return _one_line(text)

    def _write(self, final: bool = False) -> None:
        self._last_line_at = self._clock()
        try:
            self.stream.write(self.line(final) + "\n")
            self.stream.flush()
        except (ValueError, OSError):  # the stream was closed under us: progress is optional
            pass


class NoProgress:
    """A disabled progress object: the same methods, no output."""

    def __init__(self, total: float | None = None, initial: float = 0):
        self.total = total
        self.n = initial
        self.desc = ""
        self.postfix = ""

    def update(self, n: float = 1) -> None:
        """Count ``n`` more; nothing is written."""
        self.n += n

    def set_postfix(
        self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any
    ) -> None:
        """Nothing: no output."""
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Nothing: no output."""
        pass

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Nothing: no output."""
        pass

    def refresh(self) -> None:
        """Nothing: no output."""
        pass

    def close(self) -> None:
        """Nothing: no output."""
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress(
    total: float | None,
    desc: str,
    *,
    tty_bar: Callable[..., Any] | None = None,
    stream: IO[str] | None = None,
    disable: bool = False,
    unit: str | None = None,
    initial: float = 0,
    every: float = 0.05,
    every_s: float = 30.0,
    **tty_kwargs: Any,
) -> Any:
    """A progress object suited to ``stream`` (default: stderr at call time).

    ``disable``: a :class:`NoProgress`. A terminal with a ``tty_bar`` factory (e.g.
    ``tqdm.tqdm``): ``tty_bar(total=total, desc=desc, file=stream, **tty_kwargs)``, with
    ``unit`` and ``initial`` passed on too when given. Otherwise a :class:`LineProgress`
    (``tty_kwargs``, such as ``leave`` or ``bar_format``, concern the bar only).
    """
    if disable:
        return NoProgress(total, initial)
    stream = stream if stream is not None else sys.stderr
    if tty_bar is not None and _is_terminal(stream):
        if unit is not None:
            tty_kwargs["unit"] = unit
        if initial:
            tty_kwargs["initial"] = initial
        return tty_bar(total=total, desc=desc, file=stream, **tty_kwargs)
    return LineProgress(
        total, desc, stream=stream, every=every, every_s=every_s, unit=unit, initial=initial
    )
