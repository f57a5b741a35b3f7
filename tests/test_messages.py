"""detector/messages.py: the one line a library's exception contributes to a message."""

import pytest

from detector.messages import first_line, typed_first_line


@pytest.mark.parametrize("text,expected", [
    ("file not found", "file not found"),
    ("  bad value\n  full_key: model.x\n", "bad value"),
    ("\n\n  the reason\nmore", "the reason"),  # leading blank lines (omegaconf, ONNX Runtime)
    ("", "RuntimeError"),
    ("  \n ", "RuntimeError"),
])
def test_first_line(text, expected):
    assert first_line(RuntimeError(text)) == expected


def test_typed_first_line():
    assert typed_first_line(ValueError("x2 <= x1\ntrace")) == "ValueError: x2 <= x1"
    assert typed_first_line(KeyError()) == "KeyError"
    assert typed_first_line(OSError("")) == "OSError"
