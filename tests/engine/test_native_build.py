"""Building the native ops (:mod:`services.native_lib`) where it cannot work: a one-line error,
no library left behind, and ``load`` answering False (a runner then keeps the Python body), once."""

from __future__ import annotations

import pytest

from services import native_lib as native


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A state directory without a library (nor one in the default state directory), and a process
    that has not loaded one yet."""
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DARTREE_CACHE", raising=False)
    monkeypatch.setattr(native, "_LOADED", False)
    monkeypatch.setattr(native, "_GAVE_UP", False)
    return tmp_path


def test_a_missing_compiler_is_one_line_and_leaves_nothing(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler"):
        native.build_library()
    assert not native.library_path().exists() and not list((fresh / "native").rglob("*.tmp"))
    assert native.main([]) == 0 and native.main(["--strict"]) == 1  # make setup goes on; --strict fails
    assert "native slot attention not built" in capsys.readouterr().err
    assert native.load(build=True) is False and native._GAVE_UP  # logged once, not retried
    assert native.load(build=True) is False and not native.available()


def test_a_failing_compile_leaves_no_partial_library(fresh, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="building the native slot attention failed"):
        native.build_library()
    assert not native.library_path().exists() and not list((fresh / "native").rglob("*.tmp"))


def test_switched_off_it_never_loads(fresh, monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)
    assert native.load(build=True) is False and not native.available()
    assert not (fresh / "native").exists()  # nothing built either


def test_a_moved_state_directory_finds_the_default_directorys_build(fresh, monkeypatch):
    """``make setup`` builds into the default state directory; a state directory moved with
    ``$DARTREE_CACHE_DIR`` loads that build (same key) instead of answering "not built"."""
    monkeypatch.setattr(native, "build_library", lambda *a: pytest.fail("built again"))
    assert native._built_path() == native.library_path()  # nothing anywhere: the state directory's path
    default = native.library_path(fresh / "home" / ".cache" / "dartree")
    default.parent.mkdir(parents=True)
    default.write_bytes(b"")
    assert native._built_path() == default
