"""The TensorBoard sink: a run's scalars as TensorBoard event files, its PNGs as images.

One event-file folder per followed log (a *stream*): ``<logdir>`` for the run folder's own
metrics.jsonl, ``<logdir>/<its folder>`` for one beneath it (the sync baseline,
``baseline-sync``; a market seed, ``<setting>/seed-<s>``), so TensorBoard shows each as a run
of its own. Written with torch's ``SummaryWriter`` (which needs the tensorboard package),
flushed after every batch so that a TensorBoard open on the folder sees the run live.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from runkit.sinks.tags import label

EVENT_FILES = "events.out.tfevents.*"
"""The names of TensorBoard's event files."""


def available() -> str | None:
    """None when TensorBoard event files can be written here; else why not."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


class TensorBoardSink:
    """Event files under ``logdir`` (cleared when it opens: they are rebuilt from the logs)."""

    name = "TensorBoard"

    def __init__(self, logdir: Path) -> None:
        self.logdir = Path(logdir)
        self._writers: dict[str, Any] = {}

    def open(self) -> None:
        """Clear what an earlier follower wrote (the logs are read again from their start)."""
        shutil.rmtree(self.logdir, ignore_errors=True)
        self.logdir.mkdir(parents=True, exist_ok=True)

    def _writer(self, stream: str) -> Any:
        w = self._writers.get(stream)
        if w is None:
            from torch.utils.tensorboard import SummaryWriter

            w = SummaryWriter(log_dir=str(self.logdir / stream), flush_secs=5)
            self._writers[stream] = w
        return w

    def reset(self, stream: str) -> None:
        """The stream's log began again: drop what was written of it (not its sub-streams')."""
        w = self._writers.pop(stream, None)
        if w is not None:
            w.close()
        for p in (self.logdir / stream).glob(EVENT_FILES):
            p.unlink(missing_ok=True)

    def scalars(self, stream: str, rows: list[tuple[str, float, int, float]]) -> None:
        """Write ``(tag, value, step, wall time)`` rows of ``stream``."""
        w = self._writer(stream)
        for tag, value, step, wall in rows:
            w.add_scalar(tag, value, global_step=step, walltime=wall)
        w.flush()

    def images(self, pngs: list[Path], step: int) -> None:
        """The run's PNGs as images of the run folder's own stream, at ``step``."""
        import numpy as np
        from PIL import Image

        w = self._writer("")
        for p in pngs:
            with Image.open(p) as im:
                pixels = np.asarray(im.convert("RGB"))
            w.add_image(f"images/{label(p.stem)}", pixels, global_step=step, dataformats="HWC")
        w.flush()

    def close(self, ok: bool) -> None:
        """Flush and close every event file."""
        for w in self._writers.values():
            w.close()
        self._writers.clear()
