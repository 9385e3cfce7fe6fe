import pytest

from tandem.logging_config import configure_logging


def test_unknown_level_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TANDEM_LOGGING_LEVEL", "loud")
    with pytest.raises(ValueError, match="TANDEM_LOGGING_LEVEL"):
        configure_logging()


def test_cli_reports_a_bad_level_without_a_traceback(monkeypatch, capsys):
    from tandem.entrypoints.cli import main

    monkeypatch.setenv("TANDEM_LOGGING_LEVEL", "loud")
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-tokens", "1"])
    assert e.value.code == 2 and "TANDEM_LOGGING_LEVEL" in capsys.readouterr().err
