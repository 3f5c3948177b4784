"""Options: argument > ASYNCCKPT_* environment > default; nonsense is rejected with a fix."""

from __future__ import annotations

import pytest

from asyncckpt.options import CheckpointOptions, resolve_options


def test_environment_overrides_default_and_argument_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCKPT_MAX_INFLIGHT", "3")
    monkeypatch.setenv("ASYNCCKPT_CODEC", "none")
    monkeypatch.setenv("ASYNCCKPT_KEEP_LAST", "none")
    assert resolve_options().max_inflight == 3
    assert resolve_options().codec == "none"
    assert resolve_options().keep_last is None
    assert resolve_options(max_inflight=2).max_inflight == 2
    assert resolve_options().delta_reference == "full"
    monkeypatch.setenv("ASYNCCKPT_DELTA_REFERENCE", "previous")
    assert resolve_options().delta_reference == "previous"
    monkeypatch.setenv("ASYNCCKPT_MAX_INFLIGHT", "lots")
    with pytest.raises(ValueError, match="ASYNCCKPT_MAX_INFLIGHT='lots' is not an integer"):
        resolve_options()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keep_last": 0}, "keep_last must be >= 1"),
        ({"max_inflight": 0}, "max_inflight must be >= 1"),
        ({"when_busy": "drop"}, "when_busy must be"),
        ({"codec": "gzip9"}, "codec must be one of"),
        ({"snapshot": "disk"}, "snapshot must be"),
        ({"delta_reference": "base"}, "delta_reference must be 'full'"),
        ({"metrics_port": 70000}, "metrics_port"),
    ],
)
def test_nonsense_is_rejected(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointOptions(**options)  # type: ignore[arg-type]


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="keep_lats"):
        resolve_options(keep_lats=3)
