"""The one error type the checkpoint loaders raise."""
from __future__ import annotations

import os
from typing import Iterable

NAMES_SHOWN = 5


def name_list(names: Iterable[str], limit: int = NAMES_SHOWN) -> str:
    """Up to `limit` names, then how many more."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class CheckpointError(ValueError):
    """A checkpoint the loaders refuse. The message names the file and the layers (up to 5).

    Raised before any model is built, or after building when markers were left
    unconsumed; either way nothing half-loaded is returned.
    """

    def __init__(self, path, problem: str, layers: Iterable[str] = ()):
        self.path = str(path)
        self.problem = problem
        self.layers = tuple(layers)
        message = f"{os.path.basename(self.path)}: {problem}"
        if self.layers:
            message += f" (layer{'s' if len(self.layers) > 1 else ''}: {name_list(self.layers)})"
        super().__init__(message)
