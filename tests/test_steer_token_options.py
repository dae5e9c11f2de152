"""``powerlens steer --steps``: the Adam steps of --optimize, checked before any model loads."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("extra, message", [
    (["--optimize", "--objective", "token", "--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--optimize", "--steps", "-3"], "--steps must be a positive integer, got -3"),
    (["--steps", "5"], "--steps sets the Adam steps of --optimize; give --optimize too"),
])
def test_cli_steps_errors(tmp_path, capsys, extra, message):
    from powerlens.cli import main
    code = main(["steer", "no-such-model", "--text", "Hi", "--direction", "token: London", "--out",
                 str(tmp_path / "o")] + extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
