"""The progress bar (``progress=True``): tqdm's auto flavour, so it renders in notebooks too."""

from __future__ import annotations

from typing import Any


def make_bar(total_frames: int, initial: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:  # pragma: no cover
        raise ImportError("progress=True needs tqdm: pip install 'aiocollect[progress]'") from exc

    class Bar(tqdm):  # type: ignore[misc, valid-type]
        monitor_interval = 0  # no monitor thread: nothing may outlive the collector

        def update_to(self, frames: int, mean_return: float | None) -> None:
            if mean_return is not None:
                self.set_postfix_str(f"return {mean_return:.1f}", refresh=False)
            self.update(frames - self.n)

    return Bar(
        total=None if total_frames == -1 else total_frames,
        initial=initial,
        unit="frames",
        unit_scale=True,
        desc="collecting",
        dynamic_ncols=True,
    )
