"""The bridge_fgo logger under Megatron-Bridge's logging set-up (bridge_fgo/log.py)."""
import logging

import pytest

from bridge_fgo.log import logger

OTHER = logging.getLogger("megatron.bridge.some_module")  # exists before Bridge sets logging up, as ours does


@pytest.fixture
def bridge_logging():
    """Bridge's own setup_logging with its default cfg.logger.filter_warnings=True, as pretrain() calls it; every
    filter and level it set taken back afterwards."""
    from megatron.bridge.training.utils import log_utils

    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    before = {id(lg): (list(lg.filters), lg.level) for lg in loggers}
    log_utils.setup_logging(filter_warning=True)
    yield
    for lg in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        filters, level = before.get(id(lg), ([], lg.level))
        lg.filters[:] = filters
        lg.setLevel(level)


def test_our_warnings_survive_bridges_default_warning_filter(bridge_logging, caplog):
    """Bridge's default drops every WARNING of every logger that exists when it sets logging up (on two H200s,
    2026-11-27, none of bridge_fgo's reached the log); ours say where offload does not act, so they are kept,
    and anyone else's WARNINGs are still dropped as Bridge asks."""
    with caplog.at_level(logging.INFO):
        logger.warning("bridge_fgo: kept")
        OTHER.warning("other: dropped")
        logger.info("bridge_fgo: info")
    messages = [r.getMessage() for r in caplog.records]
    assert "bridge_fgo: kept" in messages and "bridge_fgo: info" in messages
    assert "other: dropped" not in messages


def test_a_level_still_silences_them(bridge_logging, caplog):
    with caplog.at_level(logging.ERROR, logger="bridge_fgo"):
        logger.warning("silenced")
    assert not [r for r in caplog.records if r.getMessage() == "silenced"]
