"""A tqdm progress callback for packing / loading experts (tqdm imports only when enabled)."""
from __future__ import annotations

from typing import Callable


def progress_bar(enabled: bool, total: int, desc: str) -> Callable[[int | None], None] | None:
    """A callback setting a tqdm bar's position (None closes it); None when disabled."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="expert", leave=False)

    def update(done: int | None) -> None:
        if done is None:
            bar.close()
        else:
            bar.update(done - bar.n)

    return update
