"""Adapter names and versions never become path traversal or ambiguous ids."""

import pytest

from lorasync.adapter._names import parse_served_name, served_name, validate_name, validate_version
from lorasync.errors import InvalidNameError
from lorasync.transports import DiskStore

HOSTILE_NAMES = [
    "../x",
    "..",
    "a/../../etc",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "nul\x00byte",
    "",
    "x" * 10_000,
    ".hidden",
    "-flag",
    "pоlicy",  # Cyrillic 'о': a look-alike
    "ｐolicy",  # full-width
    "a b",
    "a\nb",
    "a..b",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_rejected(name, tmp_path):
    with pytest.raises(InvalidNameError):
        validate_name(name)
    with pytest.raises(InvalidNameError):
        DiskStore(tmp_path).path_for(name, 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", ["../1", "-1", -1, 1.5, "1e3", "١", True, None, "", 10**16, "0x10"])
def test_hostile_versions_rejected(version):
    with pytest.raises(InvalidNameError):
        validate_version(version)


def test_good_names_and_served_round_trip(tmp_path):
    for name in ("policy", "math-v2", "code_agent.7", "A1"):
        assert validate_name(name) == name
        assert parse_served_name(served_name(name, 12)) == (name, 12)
        store = DiskStore(tmp_path)
        path = store.path_for(name, 12)
        assert path.parent.parent.parent == tmp_path and path.parent.name == store.run and path.name == "v12"
    assert validate_version("7") == 7
    assert parse_served_name("tiny") is None
    assert parse_served_name("../x@v1") is None


@pytest.mark.parametrize(
    "foreign",
    ["q@v0000000000000000007", "q@v07", "q@v00", "p@v99999999999999999999", "p@v1000000000000000", "p@v-1",
     "p@v+3", "p@v 3", "p@v3 ", "p@v٣", "p@v", "p@v3@v4x", None, 7, b"p@v3"],
)  # fmt: skip
def test_only_canonical_served_names_are_lorasyncs(foreign):
    assert parse_served_name(foreign) is None


def test_every_version_lorasync_writes_parses_back():
    for version in (0, 1, 9, 10, 999, 10**15 - 1):
        assert parse_served_name(served_name("p", version)) == ("p", version)
