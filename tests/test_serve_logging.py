"""Hypercorn's error log through the server's filter: a client hanging up mid-answer is one
line, a real failure keeps its traceback."""

from __future__ import annotations

import logging

import trio

from ninfer.server.serve import _hypercorn_error_log


def logged(error: BaseException) -> logging.LogRecord:
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = _hypercorn_error_log()
    handler = Keep(level=logging.DEBUG)
    log.addHandler(handler)
    try:
        try:
            raise error
        except BaseException:
            log.exception("Error in ASGI Framework")
    finally:
        log.removeHandler(handler)
    (record,) = records
    return record


def test_a_client_hanging_up_mid_answer_is_one_info_line():
    gone = ExceptionGroup("from a nursery", [trio.BusyResourceError("another task is sending")])
    record = logged(gone)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == "a client hung up while its answer was being sent (BusyResourceError)"


def test_a_real_failure_keeps_its_traceback():
    mixed = ExceptionGroup("from a nursery", [trio.BrokenResourceError(), ValueError("a bug")])
    for error in (ValueError("a bug"), mixed):
        record = logged(error)
        assert record.levelno == logging.ERROR and record.exc_info is not None
