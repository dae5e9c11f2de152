"""Careless and hostile use of the command line: output folders never mix runs, concurrent
writers cannot corrupt each other, and every failure is one line with exit status 2.

Each case builds its bad input in a temporary folder and checks the exit code, the one-line
message naming the culprit, and that nothing was written or changed.
"""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from powerlens._src import io
from powerlens.cli import join_negative_values, main

FAST = ["simulate", "--spectrum", "2,0.5", "--dim", "4", "--steps", "3", "--tokens", "4", "--quiet"]


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def snapshot(folder):
    return {os.path.relpath(os.path.join(r, f), folder): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(folder) for f in fs}


def test_a_second_run_replaces_the_folder_whole(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, *FAST, "--save-states", "--out", str(out))[0] == 0
    assert (out / "states.npy").exists()
    assert run(capsys, *FAST, "--steps", "5", "--out", str(out))[0] == 0
    assert not (out / "states.npy").exists()                       # nothing of the first run is left
    doc = json.loads((out / "metrics.json").read_text())
    assert len(doc["steps"]) == 6
    assert io.read_marker(str(out))["command"] == "simulate"
    assert not [e for e in os.listdir(tmp_path) if ".partial-" in e or ".old-" in e]


def test_empty_out_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, *FAST, "--out", "")
    assert code == 2 and "--out is empty" in one_line(err)
    assert os.listdir(tmp_path) == []


def test_a_foreign_folder_is_refused_even_with_overwrite(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    for extra in ([], ["--overwrite"]):
        code, err = run(capsys, *FAST, "--out", str(out), *extra)
        assert code == 2
        line = one_line(err)
        assert "'thesis.tex' was not written by powerlens" in line and "--overwrite" not in line
        assert snapshot(out) == {"thesis.tex": b"precious"}


def test_an_empty_existing_folder_is_used(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert run(capsys, *FAST, "--out", str(out))[0] == 0
    assert (out / "metrics.json").exists()


def test_out_that_is_a_file_or_unwritable(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for argv in (FAST + ["--out", str(f)], ["reproduce", "--quick", "--out", str(f)]):
        code, err = run(capsys, *argv)
        assert code == 2 and "exists and is not a directory" in one_line(err)
    assert f.read_text() == "x"
    code, err = run(capsys, *FAST, "--out", "/proc/powerlens-cannot-write-here")
    assert code == 2 and "cannot write there" in one_line(err)


def test_folders_get_the_usual_permissions(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        out = tmp_path / "perm"
        assert run(capsys, *FAST, "--out", str(out))[0] == 0
    finally:
        os.umask(old)
    assert oct(os.stat(out).st_mode & 0o777) == "0o755"
    assert oct(os.stat(out / "metrics.json").st_mode & 0o777) == "0o644"


def test_a_killed_runs_staging_folder_is_cleaned_up(tmp_path, capsys):
    stale = tmp_path / ".run.partial-abc123"
    stale.mkdir()
    (stale / io.STAGE_MARKER).write_text(io.STAGE_TEXT)      # made by powerlens (a user's folder is kept)
    (stale / "big.npy").write_bytes(b"0" * 1000)
    assert run(capsys, *FAST, "--out", str(tmp_path / "run"))[0] == 0
    assert not stale.exists()


def test_a_second_writer_is_refused(tmp_path, capsys):
    out = tmp_path / "busy"
    with io.folder_lock(str(out)):
        code, err = run(capsys, *FAST, "--out", str(out))
    assert code == 2
    assert "being written by another powerlens run" in one_line(err) and str(os.getpid()) in err
    assert not out.exists()


def test_concurrent_figure_saves_do_not_collide(tmp_path):
    """Two writers of one figure path use unique temporary names: both succeed."""
    from powerlens._src.analysis import plots
    path = tmp_path / "fig.png"
    errors = []

    def save(i):
        try:
            for _ in range(5):
                plots.plot_curve(np.arange(10.0), {"a": np.arange(10.0) * i}, str(path), xlabel="x", ylabel="y",
                                 title=f"run {i}")
        except Exception as exc:      # noqa: BLE001 - the test reports any failure
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["fig.png"]


def _marked_reproduce_folder(out, **settings):
    from powerlens._src import reproduce
    base = {"quick": True, "seed": 0, "models": [], "sections": ["bipartite"]}
    reproduce.prepare_folder(str(out), dict(base, **settings), overwrite=False)
    (out / "results.json").write_text("{}")


def test_reproduce_refuses_other_settings_naming_them(tmp_path, capsys):
    out = tmp_path / "r"
    _marked_reproduce_folder(out, seed=0)
    before = snapshot(out)
    code, err = run(capsys, "reproduce", "--quick", "--seed", "1", "--sections", "bipartite", "--out", str(out))
    assert code == 2
    line = one_line(err)
    assert "other settings" in line and "seed 0 -> 1" in line and "--overwrite" in line
    assert snapshot(out) == before
    code, err = run(capsys, "reproduce", "--seed", "0", "--sections", "bipartite", "--out", str(out))
    assert code == 2 and "quick True -> False" in one_line(err)


def test_reproduce_refuses_another_commands_folder_and_foreign_ones(tmp_path, capsys):
    sim = tmp_path / "sim"
    assert run(capsys, *FAST, "--out", str(sim))[0] == 0
    code, err = run(capsys, "reproduce", "--quick", "--out", str(sim))
    assert code == 2 and "powerlens simulate" in one_line(err)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        code, err = run(capsys, "reproduce", "--quick", "--out", str(foreign), *extra)
        line = one_line(err)
        assert code == 2 and "'notes.txt' was not written by powerlens" in line and "--overwrite" not in line
        assert snapshot(foreign) == {"notes.txt": b"mine"}


def test_reproduce_overwrite_starts_afresh(tmp_path, capsys, monkeypatch):
    from powerlens._src import reproduce
    from powerlens._src.reproduce.section import SectionResult

    def section_bipartite(ctx):           # the name matches --sections bipartite
        return SectionResult("tiny", "Tiny", "claim", "supported", "ok", {"seed": ctx.seed})

    monkeypatch.setattr(reproduce, "all_sections", lambda: [section_bipartite])
    out = tmp_path / "r"
    _marked_reproduce_folder(out, seed=0)
    (out / "figures").mkdir()
    io.claim(str(out), "figures/old_seed0.png")               # the seed-0 run listed it as it wrote it
    (out / "figures" / "old_seed0.png").write_bytes(b"old")
    code, _ = run(capsys, "reproduce", "--quick", "--seed", "1", "--sections", "bipartite", "--out", str(out),
                  "--overwrite")
    assert code == 0
    assert not (out / "figures" / "old_seed0.png").exists()          # nothing of the seed-0 run is left
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["seed"] == 1 and doc["sections"][0]["numbers"]["seed"] == 1
    assert io.read_marker(str(out))["settings"]["seed"] == 1


def test_negative_spectrum_values_are_accepted():
    assert join_negative_values(["simulate", "--spectrum", "-0.5,2", "--dim", "4"]) == \
        ["simulate", "--spectrum=-0.5,2", "--dim", "4"]
    assert join_negative_values(["--alpha", "-3"]) == ["--alpha=-3"]
    assert join_negative_values(["--quiet", "--x64"]) == ["--quiet", "--x64"]


def test_negative_spectrum_runs(tmp_path, capsys):
    code, err = run(capsys, "simulate", "--spectrum", "-0.5,2,0.3", "--steps", "3", "--quiet",
                    "--out", str(tmp_path / "neg"))
    assert code == 0, err


@pytest.mark.parametrize("exc, words", [
    (RuntimeError("something deep broke"), "RuntimeError: something deep broke"),
    (MemoryError(), "out of memory"),
    (PermissionError(13, "Permission denied", "/data/x.npy"), "cannot access '/data/x.npy': Permission denied"),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1e12 bytes"), "ran out of memory"),
])
def test_unexpected_errors_are_one_line(exc, words, capsys, monkeypatch, tmp_path):
    from powerlens._src.commands import simulate

    def boom(args):
        raise exc

    monkeypatch.setattr(simulate, "cmd_simulate", boom)
    code, err = run(capsys, *FAST, "--out", str(tmp_path / "x"))
    line = one_line(err)
    assert code == 2 and words in line and "--debug" in line
    with pytest.raises(type(exc)):
        main([*FAST, "--out", str(tmp_path / "x"), "--debug"])
