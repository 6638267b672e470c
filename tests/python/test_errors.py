"""tandem::Error reaches Python as the matching built-in exception with the same text."""
import pytest

from tandem import _C


@pytest.mark.parametrize("code,exc", [
    ("invalid_argument", ValueError),
    ("bad_format", ValueError),
    ("unsupported", ValueError),
    ("io", OSError),
    ("internal", RuntimeError),
])
def test_error_mapping(code, exc):
    with pytest.raises(exc) as info:
        _C._raise(code, f"boom {code}")
    assert str(info.value).startswith(f"boom {code}  [at python/bindings.cpp:")
    # Only the mapped type: an io error is not a ValueError and vice versa.
    for other in {ValueError, OSError, RuntimeError} - {exc}:
        assert not isinstance(info.value, other) or issubclass(exc, other)


def test_message_bytes_that_are_not_utf8_are_escaped_not_a_decode_error():
    # A message may quote bytes of the user's file (a config key, a header): the error keeps
    # its type and text, with \xNN escapes, instead of becoming a bare UnicodeDecodeError.
    with pytest.raises(ValueError) as info:
        _C._raise("invalid_argument", b"bad.yaml:1:1: \xff\xfe: unknown key")
    assert str(info.value).startswith("bad.yaml:1:1: \\xff\\xfe: unknown key  [at python/bindings.cpp:")
