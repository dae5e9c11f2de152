"""Output folders never lose a user's file: powerlens removes or replaces only what it wrote.

Every command (simulate, spectrum, align, steer, sweep, reproduce) goes through one decision,
``powerlens._src.io.decide_folder``. Each case builds a folder in a temporary directory, runs the
command in-process, and checks the exit status, the one-line message, that every file of the
user's (at the top, in a subfolder, behind a symlink pointing out of the folder) is byte for
byte as it was, and that no lock or staging file is left anywhere.
"""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from powerlens._src import io, reproduce
from powerlens.cli import main
from powerlens._src.reproduce.section import SectionResult

COMMANDS = ["simulate", "spectrum", "align", "steer", "sweep", "reproduce"]
RESUMABLE = {"sweep", "reproduce"}
FOREIGN = ("'link' (a symbolic link)", "'mydata/notes.txt'", "'thesis.tex'")

TINY_SWEEP = """
name = "tiny"
seed = 1
[grid]
beta = [1.0]
[system]
d = 4
tokens = 4
heads = 1
replicates = 2
[run]
steps = 5
"""


def section_tiny(ctx):
    """A reproduce section that costs nothing and writes like a real one: a chunk and a figure."""
    numbers = ctx.store.cached("tiny-chunk", lambda: {"seed": ctx.seed})
    io.write_bytes(ctx.fig("s0_tiny.png"), b"\x89PNG\r\n\x1a\n")
    return SectionResult("tiny", "Tiny", "claim", "supported", "ok", numbers, figures=[ctx.fig("s0_tiny.png")])


@pytest.fixture(autouse=True)
def tiny_reproduce(monkeypatch):
    monkeypatch.setattr(reproduce, "all_sections", lambda: [section_tiny])


def argv(command, out, tmp_path, *extra):
    """The cheapest invocation of ``command`` writing into ``out``."""
    out = str(out)
    if command == "simulate":
        base = ["simulate", "--spectrum", "2,0.5", "--dim", "4", "--steps", "3", "--tokens", "4", "--quiet"]
    elif command == "spectrum":
        base = ["spectrum", "--spectrum", "2,0.5", "--dim", "4"]
    elif command == "align":
        base = ["align", "minilm", "--text", "hi", "--quiet"]
    elif command == "steer":
        base = ["steer", "minilm", "--direction", "random", "--alpha", "1", "--text", "hi"]
    elif command == "sweep":
        spec = tmp_path / "tiny.toml"
        spec.write_text(TINY_SWEEP)
        base = ["sweep", str(spec), "--quiet"]
    else:
        base = ["reproduce", "--quick", "--sections", "tiny", "--jobs", "1"]
    return base + ["--out", out, *extra]


def run(capsys, args):
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


def one_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(root):
    """Every entry below ``root``: file bytes, symlink targets (never followed), empty folders."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[rel] = fh.read()
            else:
                out[rel] = "dir"
    return out


def leftovers(root):
    """Lock and staging files anywhere below ``root``."""
    return [os.path.join(f, n) for f, dirs, files in os.walk(root) for n in dirs + files
            if n.endswith(".lock") or ".partial-" in n or ".old-" in n]


@pytest.fixture(scope="module")
def simulate_output(tmp_path_factory):
    """A folder that ``simulate`` wrote (copy it with :func:`shutil.copytree` before changing it)."""
    out = tmp_path_factory.mktemp("simulated") / "run"
    assert main(argv("simulate", out, None)) == 0
    return out


def users_folder(folder, outside):
    """A folder of the user's: a file at the top, one in a subfolder, a symlink out of it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "thesis.tex").write_text("precious")
    (folder / "mydata").mkdir()
    (folder / "mydata" / "notes.txt").write_text("notes")
    outside.mkdir(exist_ok=True)
    (outside / "keep.txt").write_text("not yours either")
    os.symlink(os.path.relpath(outside, folder), folder / "link")


def sweep_folder(folder):
    """A sweep folder as ``sweep`` leaves it mid-run: marked, one finished chunk, one being written."""
    from powerlens._src.sweeps import load_spec
    from powerlens._src.sweeps.store import prepare_folder
    spec = load_spec({"seed": 1, "grid": {"beta": [1.0]}, "system": {"d": 4, "tokens": 4}, "run": {"steps": 5}})
    prepare_folder(str(folder), spec.to_dict(), "start")
    (folder / ".chunks").mkdir()
    io.claim(str(folder), ".chunks/c0000.json")              # each chunk is listed before it is written
    io.claim(str(folder), ".chunks/c0001.json")
    (folder / ".chunks" / "c0000.json").write_text("{}")
    (folder / ".chunks" / ".c0001.json.k3x_9q.tmp").write_text("{")


# ------------------------------------------------------------------ files of the user's are never touched

@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_users_folder_is_refused_and_left_as_it_was(command, overwrite, tmp_path, capsys):
    out, outside = tmp_path / "mine", tmp_path / "outside"
    users_folder(out, outside)
    args = argv(command, out, tmp_path, *["--overwrite"] * overwrite)
    before = snapshot(tmp_path)
    code, err = run(capsys, args)
    line = one_line(err)
    assert code == 2 and line.startswith(f"powerlens {command}: error: --out {out}")
    assert "was not written by powerlens" in line and any(name in line for name in FOREIGN), line
    assert "--overwrite" not in line and f"choose a new folder, e.g. --out {out}/{command}" in line
    assert snapshot(tmp_path) == before                 # the link's target too; no lock, staging or marker
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("where", ["top", "subfolder"])
@pytest.mark.parametrize("command", COMMANDS)
def test_one_user_file_in_a_powerlens_folder_is_named_and_kept(command, where, tmp_path, capsys, simulate_output):
    out = tmp_path / "run"
    shutil.copytree(simulate_output, out, symlinks=True)
    extra = "notes.txt" if where == "top" else "sub/notes.txt"
    os.makedirs(os.path.dirname(out / extra), exist_ok=True)
    (out / extra).write_text("mine")
    before = snapshot(out)
    for flags in ([], ["--overwrite"]):
        code, err = run(capsys, argv(command, out, tmp_path, *flags))
        line = one_line(err)
        assert code == 2 and f"'{extra}' was not written by powerlens" in line and "--overwrite" not in line
        assert snapshot(out) == before
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("extra", [".chunks/notes.txt", "figures/notes.txt", "figures/mine/", "cache.bin"])
def test_a_user_file_among_a_sweeps_chunks_and_figures_is_foreign(extra, tmp_path, capsys):
    out = tmp_path / "sweep"
    sweep_folder(out)
    assert list(io.foreign_entries(str(out))) == []     # marker, chunks, a chunk being written: all ours
    os.makedirs(out / os.path.dirname(extra.rstrip("/")), exist_ok=True)
    if extra.endswith("/"):
        (out / extra).mkdir()
    else:
        (out / extra).write_text("mine")
    before = snapshot(out)
    assert list(io.foreign_entries(str(out))) == [extra]
    for flags in ([], ["--overwrite"]):
        code, err = run(capsys, argv("sweep", out, tmp_path, *flags))
        assert code == 2 and f"'{extra}' was not written by powerlens" in one_line(err)
        assert snapshot(out) == before


def test_removing_a_powerlens_folder_never_follows_a_symlink(tmp_path):
    """remove_owned deletes what the marker lists and nothing else, even a marker listing a
    path through a symlink or out of the folder."""
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "c0000.json").write_text("theirs")
    (outside / "precious").write_text("theirs")
    out.mkdir()
    os.symlink(outside, out / ".chunks")                          # an owned name, but a symlink
    (out / "results.csv").write_text("ours")
    (out / "figures").mkdir()
    (out / "figures" / "a.png").write_text("ours")
    (out / "figures" / "notes.txt").write_text("mine")
    io.write_marker(str(out), "sweep", {}, files=["results.csv", "../outside/precious", ".chunks/c0000.json",
                                                  "figures/a.png"], folders=[".chunks", "figures"])
    assert sorted(io.foreign_entries(str(out))) == [".chunks", "figures/notes.txt"]
    io.remove_owned(str(out))
    assert snapshot(out) == {".chunks": ("link", str(outside)), "figures": "dir", "figures/notes.txt": b"mine"}
    assert snapshot(outside) == {"c0000.json": b"theirs", "precious": b"theirs"}


# ------------------------------------------------------------------ folders no command may take

@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("command", COMMANDS)
def test_the_current_folder_its_parents_and_home_are_refused(command, overwrite, tmp_path, capsys, monkeypatch):
    home, outside = tmp_path / "home", tmp_path / "outside"
    here = home / "project" / "sub"
    users_folder(here, outside)
    (home / "diary.txt").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("POWERLENS_XLA_CACHE", "off")       # nothing of powerlens's in the made-up home
    monkeypatch.chdir(here)
    flags = ["--overwrite"] * overwrite
    spec = tmp_path / "spec"
    spec.mkdir()
    before = snapshot(home), snapshot(outside)
    cases = {".": "the current folder", str(here): "the current folder", "..": "a folder above the current one",
             str(home / "project"): "a folder above the current one", "/": "a folder above the current one",
             "~": "the home folder", str(home): "the home folder", str(tmp_path): "a folder above the current one"}
    for path, why in cases.items():
        code, err = run(capsys, argv(command, path, spec, *flags))
        line = one_line(err)
        assert code == 2 and f"--out {path}: " in line and f"is {why} and cannot be an output folder" in line, line
        assert "--overwrite" not in line
        assert (snapshot(home), snapshot(outside)) == before, path
        assert not leftovers(tmp_path)
    code, err = run(capsys, argv(command, ".", spec, *flags))
    assert f"choose a new folder, e.g. --out ./{command}" in err


# ------------------------------------------------------------------ what powerlens wrote is replaced

@pytest.mark.parametrize("command", [
    "simulate", "spectrum", "sweep", "reproduce",
    pytest.param("align", marks=pytest.mark.slow), pytest.param("steer", marks=pytest.mark.slow)])
def test_overwrite_replaces_a_folder_another_command_wrote(command, tmp_path, capsys):
    out = tmp_path / "run"
    other = "spectrum" if command == "simulate" else "simulate"
    assert run(capsys, argv(other, out, tmp_path))[0] == 0
    if command in RESUMABLE:                     # resumes its own folders: another command's is refused
        before = snapshot(out)
        code, err = run(capsys, argv(command, out, tmp_path))
        line = one_line(err)
        assert code == 2 and f"holds the output of `powerlens {other}`" in line and "--overwrite" in line
        assert snapshot(out) == before
    code, _ = run(capsys, argv(command, out, tmp_path, "--overwrite"))
    assert code == 0
    marker = io.read_marker(str(out))
    assert marker["command"] == command
    assert not (out / {"simulate": "metrics.json", "spectrum": "spectrum.json"}[other]).exists()
    assert list(io.foreign_entries(str(out))) == []                 # the marker covers every file written
    files = {os.path.relpath(os.path.join(f, n), out) for f, _, ns in os.walk(out) for n in ns} - {io.MARKER}
    if command in RESUMABLE:                                        # the top files by name, the figures by pattern
        assert set(marker["files"]) <= files and "report.html" in files
        assert set(marker["folders"]) == {".chunks", "figures"}
    else:
        assert set(marker["files"]) == files                        # every file by name
    assert not leftovers(tmp_path)


def reseeded(command, out, tmp_path):
    """``command`` with other settings than :func:`argv`'s."""
    if command == "sweep":
        spec = tmp_path / "reseeded.toml"
        spec.write_text(TINY_SWEEP.replace("seed = 1", "seed = 2"))
        return ["sweep", str(spec), "--quiet", "--out", str(out)]
    return argv(command, out, tmp_path, *(["--dim", "6"] if command == "spectrum" else ["--seed", "2"]))


@pytest.mark.parametrize("command", ["simulate", "spectrum", "sweep", "reproduce"])
def test_overwrite_replaces_a_folder_written_with_other_settings(command, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, argv(command, out, tmp_path))[0] == 0
    changed = reseeded(command, out, tmp_path)
    if command in RESUMABLE:                     # would resume: other settings are refused naming them
        code, err = run(capsys, changed)
        line = one_line(err)
        assert code == 2 and "--overwrite" in line and ("seed 0 -> 2" in line or "keys that differ: seed" in line)
    assert run(capsys, changed + ["--overwrite"])[0] == 0
    assert list(io.foreign_entries(str(out))) == [] and not leftovers(tmp_path)
    if command == "sweep":
        assert io.read_marker(str(out))["settings"]["spec"]["seed"] == 2
        assert json.loads((out / "sweep.json").read_text())["spec"]["seed"] == 2
    elif command == "reproduce":
        assert io.read_marker(str(out))["settings"]["seed"] == 2
        assert json.loads((out / "results.json").read_text())["sections"][0]["numbers"] == {"seed": 2}
    else:
        doc = json.loads((out / f"{'metrics' if command == 'simulate' else 'spectrum'}.json").read_text())
        assert doc["settings"]["dim" if command == "spectrum" else "seed"] in (6, 2)


def test_a_resumable_folder_resumes_with_a_killed_runs_leftovers(tmp_path, capsys):
    """A chunk and a figure that a killed reproduce left (and a file it was writing) are its own."""
    out = tmp_path / "r"
    settings = {"quick": True, "seed": 0, "models": [], "sections": ["tiny"]}
    reproduce.prepare_folder(str(out), settings, overwrite=False)
    (out / "figures").mkdir()
    io.claim(str(out), "figures/s9_partial.png")             # listed before it is written, as ctx.fig does
    (out / "figures" / "s9_partial.png").write_bytes(b"old")
    (out / ".results.json.a1b2c3.tmp").write_text("{")
    assert list(io.foreign_entries(str(out))) == []
    code, _ = run(capsys, argv("reproduce", out, tmp_path))
    assert code == 0 and (out / "results.json").is_file() and (out / "figures" / "s0_tiny.png").is_file()
    assert list(io.foreign_entries(str(out))) == [] and not leftovers(tmp_path)


# ------------------------------------------------------------------ no lock file, no half-made folder

def test_no_lock_file_after_success_refusal_or_error(tmp_path, capsys, monkeypatch):
    out = tmp_path / "a" / "b" / "run"
    assert run(capsys, argv("simulate", out, tmp_path))[0] == 0
    assert not leftovers(tmp_path)
    with io.folder_lock(str(out)):                                  # another writer holds it
        assert os.path.isfile(tmp_path / "a" / "b" / ".run.lock")
        code, err = run(capsys, argv("simulate", out, tmp_path))
        assert code == 2 and "being written by another powerlens run" in one_line(err)
    assert not leftovers(tmp_path)
    with io.folder_lock(str(out)):                                  # and it can be taken again
        pass

    from powerlens._src.analysis import plots
    monkeypatch.setattr(plots, "plot_eigenvalues", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("plot failed")))
    deep = tmp_path / "new" / "deeper" / "run"
    code, err = run(capsys, argv("spectrum", deep, tmp_path))
    assert code == 2 and "plot failed" in one_line(err)
    assert not (tmp_path / "new").exists() and not leftovers(tmp_path)     # the folders made for it are gone too


def test_a_full_disk_is_one_line_naming_the_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run(capsys, argv("simulate", out, tmp_path))[0] == 0
    before = snapshot(tmp_path)

    def full(path, write):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io, "atomic_write", full)
    for command in ("simulate", "reproduce"):
        code, err = run(capsys, argv(command, tmp_path / command, tmp_path))
        line = one_line(err)
        assert code == 2 and f"--out {tmp_path / command}: the disk is full" in line, line
    code, err = run(capsys, argv("simulate", out, tmp_path))
    assert code == 2 and f"--out {out}: the disk is full" in one_line(err)
    assert snapshot(tmp_path) == before and not leftovers(tmp_path)  # the old result stands
