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
