"""Where the kernels' tuning store lives (quant/tuning.py): `bigdit_tuning.json` beside the quantize-once cache's
folder (models/bigdit_tuning.json by default; see host/cache.py for the folder), read again at each load and at
each attention node's apply. Attention's `auto` keeps its measured decisions there too (attention/auto.py)."""
from __future__ import annotations

import os

from ..attention import auto as attention_auto
from ..quant import tuning
from .cache import cache_folder

ATTENTION_DECISIONS = tuning.KernelEntries(attention_auto.STORE_KERNEL)


def tuning_file() -> str:
    return os.path.join(os.path.dirname(cache_folder()), tuning.FILE_NAME)


def use_tuning_store() -> None:
    """Point the kernels at the store in the host's models folder, as it is on disk now (another server may have
    added to it)."""
    tuning.use(tuning_file())
    attention_auto.use_store(ATTENTION_DECISIONS)
