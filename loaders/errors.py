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


def with_layers(message: str, layers: tuple[str, ...]) -> str:
    """`message`, then the layers it concerns (up to five) where there are any."""
    if not layers:
        return message
    return f"{message} (layer{'s' if len(layers) > 1 else ''}: {name_list(layers)})"


class CheckpointError(ValueError):
    """A checkpoint the loaders refuse. The message names the file and the layers (up to 5).

    Raised before any model is built, or after building when markers were left
    unconsumed; either way nothing half-loaded is returned.
    """

    def __init__(self, path, problem: str, layers: Iterable[str] = ()):
        self.path = str(path)
        self.problem = problem
        self.layers = tuple(layers)
        super().__init__(with_layers(f"{os.path.basename(self.path)}: {problem}", self.layers))
