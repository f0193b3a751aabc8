"""scripts/sanitizer_workload.py runs under compute-sanitizer on a GPU: check here that it runs every
section on the CPU backend, and that it refuses what it does not know."""

import pytest

from helpers import load_script


def test_every_section_runs_on_cpu(capsys):
    assert load_script("sanitizer_workload").main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for section in ("routing", "em", "conv", "attention"):
        assert f"{section}: done" in out


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        load_script("sanitizer_workload").main(["--device", "cpu", "routin"])
    assert "unknown section(s) routin" in capsys.readouterr().err
