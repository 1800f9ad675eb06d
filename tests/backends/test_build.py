"""Build artifacts on disk: the modes of what a build writes, so a cache shared by users or CI jobs stays usable."""

import os
import stat

import pytest

from attnzoo.backends.triton import build as builder


@pytest.fixture
def restore_umask():
    """Put the process umask back after a test that sets it."""
    old = os.umask(0o077)  # reading the umask means setting it
    os.umask(old)
    yield
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["umask022", "umask002"])
def test_artifact_modes_follow_the_umask(mask, restore_umask, tmp_path):
    os.umask(mask)
    artifact = builder.build("vanilla", root=tmp_path / "cache")
    files = sorted(artifact.directory.iterdir())
    assert {p.name for p in files} == {*builder.SOURCES.values(), builder.MANIFEST}  # no temporary left behind
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path.name
    for directory in (artifact.directory, artifact.directory.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~mask, directory
    assert builder.build("vanilla", root=tmp_path / "cache").hit  # and it reads back as a whole artifact


@pytest.mark.parametrize("damage", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe not utf-8", b"{\"key\": 1}"],
                         ids=["nested", "not-utf8", "wrong-key"])
def test_a_damaged_manifest_is_built_again(tmp_path, damage):
    """A manifest that does not parse (nested past Python's stack: RecursionError, not a ValueError) or names
    another key is a damaged artifact: the next build writes it afresh instead of raising."""
    artifact = builder.build("vanilla", root=tmp_path / "cache")
    (artifact.directory / builder.MANIFEST).write_bytes(damage)
    again = builder.build("vanilla", root=tmp_path / "cache")
    assert not again.hit and builder.build("vanilla", root=tmp_path / "cache").hit
