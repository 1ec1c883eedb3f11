"""The services' log handler writes to the ``sys.stderr`` of the moment a record is written."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from services.common.config import load_settings
from services.common.logs import setup_logging


def test_a_record_goes_to_the_current_stderr_after_the_first_one_was_replaced_and_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    try:
        setup_logging(load_settings(None))
        logging.getLogger("draftstream.test").warning("one")
        first.close()  # as a CLI runner closes the stream it captured a run with
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("draftstream.test").warning("two")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    written = second.getvalue()
    assert written.rstrip().endswith("WARNING draftstream.test: two"), written
    assert "Logging error" not in written, written
