"""Every line the pack logs starts with one prefix, through one helper."""
import logging
import re
from pathlib import Path

from bigdit.pack_logging import PREFIX, pack_logger

PACK_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nodes", "quant", "attention", "loaders")


def test_pack_logger_prefixes_every_message(caplog):
    log = pack_logger("bigdit.quant.example")
    with caplog.at_level(logging.INFO, logger="bigdit.quant.example"):
        log.info("%s: %d layers", "QuantizeModelINT8", 3)
        log.warning("plain")
    assert [r.getMessage() for r in caplog.records] == [f"{PREFIX}QuantizeModelINT8: 3 layers", f"{PREFIX}plain"]
    assert {r.name for r in caplog.records} == {"bigdit.quant.example"}  # filters by module keep working


def test_no_module_logs_around_the_helper():
    sources = [p for package in PACKAGES for p in (PACK_ROOT / package).rglob("*.py")]
    assert len(sources) > 20
    offenders = [f"{p.relative_to(PACK_ROOT)}: {m.group(0)}" for p in sources
                 for m in re.finditer(r"logging\.getLogger\(|^\s*print\(|logging\.(debug|info|warning|error)\(",
                                      p.read_text(), re.M)]
    assert not offenders, offenders
