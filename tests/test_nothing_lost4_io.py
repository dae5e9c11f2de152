"""Nothing powerlens did not write is touched: the lock beside ``--out`` (never through a link,
never a user's file), sweep and reproduce folders whose chunks and figures are listed one by
one (``--overwrite`` keeps or names anything else), staging folders removed only with
powerlens's staging marker, damaged or forged chunks named and recomputed, and a model
sweep's checkpoint identified by a hash of every byte."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from powerlens._src import io
from powerlens.cli import main

FAST = ["simulate", "--spectrum", "2,0.5", "--dim", "4", "--steps", "3", "--tokens", "4", "--quiet"]
SWEEP = {"seed": 0, "grid": {"beta": [1.0, 2.0]}, "system": {"d": 4, "tokens": 4, "replicates": 2},
         "run": {"steps": 8, "chunk_size": 2}}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder) -> dict:
    """Every file below ``folder`` (links as their target, not followed) -> its bytes."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                out[rel] = open(path, "rb").read()
    return out


# ------------------------------------------------------------------ 1. the lock file

def test_a_symlink_at_the_lock_path_is_refused_and_neither_followed_nor_removed(tmp_path, capsys):
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "v1.txt").write_text("precious")
    os.symlink("victim/v1.txt", tmp_path / ".out.lock")               # aimed at a user's file
    os.symlink("victim/made.txt", tmp_path / ".out2.lock")            # dangling: would create its target
    before = snapshot(tmp_path)
    for name in ("out", "out2"):
        code, err = run(capsys, *FAST, "--out", tmp_path / name)
        line = one_line(err)
        assert code == 2 and f".{name}.lock is a symbolic link" in line and "--out" in line, line
    assert snapshot(tmp_path) == before                               # target unchanged, nothing created


def test_a_users_file_at_the_lock_path_is_refused_and_kept(tmp_path, capsys):
    for text in ("mine\n", "", "powerlens lock, pid x\n"):
        (tmp_path / ".out.lock").write_text(text)
        code, err = run(capsys, *FAST, "--out", tmp_path / "out")
        assert code == 2 and "is a file that powerlens did not write" in one_line(err)
        assert (tmp_path / ".out.lock").read_text() == text and not (tmp_path / "out").exists()
    os.mkfifo(tmp_path / ".fifo.lock")                                 # not a plain file: not opened
    code, err = run(capsys, *FAST, "--out", tmp_path / "fifo")
    assert code == 2 and "is not a plain file" in one_line(err)


@pytest.mark.parametrize("text", ["powerlens lock, pid 4194999\n", "4194999"], ids=["lock", "older lock"])
def test_a_killed_runs_lock_is_recognised_and_taken_over(tmp_path, capsys, text):
    (tmp_path / ".out.lock").write_text(text)                         # left by a run killed with -9
    code, err = run(capsys, *FAST, "--out", tmp_path / "out")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["out"]                     # ours: removed as the run ended
    with io.folder_lock(str(tmp_path / "out")):                        # a held lock holds our pid
        assert (tmp_path / ".out.lock").read_text() == f"powerlens lock, pid {os.getpid()}\n"
        code, err = run(capsys, *FAST, "--out", tmp_path / "out")
        assert code == 2 and f"another powerlens run (pid {os.getpid()})" in one_line(err)
    assert not (tmp_path / ".out.lock").exists()


# ------------------------------------------------------------------ 3. every file of a resumable run is listed

def test_sweep_overwrite_keeps_a_users_files_among_chunks_and_figures(tmp_path, capsys):
    from powerlens._src.sweeps.api import sweep
    out = tmp_path / "K"
    sweep(SWEEP, out=str(out), progress=False)
    ours = sorted(os.listdir(out / "figures")) + sorted(os.listdir(out / ".chunks"))
    assert len(ours) >= 3 and list(io.foreign_entries(str(out))) == []
    (out / "figures" / "my_plot.png").write_text("mine")
    (out / ".chunks" / "my_notes.json").write_text("mine")
    spec6 = tmp_path / "base6.toml"
    spec6.write_text("[grid]\nbeta = [1.0, 2.0]\n[system]\nd = 4\ntokens = 4\nreplicates = 6\n[run]\nsteps = 8\n")
    before = snapshot(out)
    code, err = run(capsys, "sweep", spec6, "--out", out, "--overwrite", "--quiet")
    assert code == 2 and "'.chunks/my_notes.json' was not written by powerlens" in one_line(err)
    assert snapshot(out) == before
    os.unlink(out / ".chunks" / "my_notes.json")                     # the figure alone is named too
    code, err = run(capsys, "sweep", spec6, "--out", out, "--overwrite", "--quiet")
    assert code == 2 and "'figures/my_plot.png' was not written by powerlens" in one_line(err)
    # what --overwrite removes is what the marker and the ledgers list: the user's file stays
    io.remove_owned(str(out))
    assert snapshot(out) == {"figures/my_plot.png": b"mine"} and sorted(os.listdir(out)) == ["figures"]


def test_remove_owned_removes_exactly_what_the_marker_and_ledgers_list(tmp_path):
    out = tmp_path / "run"
    io.mark_resumable(str(out), "sweep", {}, files=["results.csv"], folders=[".chunks", "figures"])
    (out / ".chunks" / "KEY").mkdir(parents=True)
    (out / "figures").mkdir()
    for rel in (".chunks/KEY/", ".chunks/KEY/a.json", "figures/a.png"):
        io.claim(str(out), rel)
    code = ("from powerlens._src import io; import sys; io.claim(sys.argv[1], '.chunks/KEY/b.json')")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True)      # another process: its own ledger
    ledgers = sorted(n for n in os.listdir(out) if n.startswith(io.LEDGER))
    assert len(ledgers) == 2
    for rel, text in {"results.csv": "ours", ".chunks/KEY/a.json": "ours", ".chunks/KEY/b.json": "ours",
                      "figures/a.png": "ours", ".chunks/KEY/c.json": "mine", "figures/b.png": "mine",
                      ".chunks/notes.json": "mine"}.items():
        (out / rel).write_text(text)
    (out / ".chunks" / ".a.json.x1y2.tmp").write_text("{")           # not ours: no listed a.json at that level
    (out / ".chunks" / "KEY" / ".b.json.x1y2.tmp").write_text("{")    # ours: b.json being written
    assert sorted(io.foreign_entries(str(out))) == [".chunks/.a.json.x1y2.tmp", ".chunks/KEY/c.json",
                                                    ".chunks/notes.json", "figures/b.png"]
    io.remove_owned(str(out))                                          # ledgers and marker included
    assert snapshot(out) == {".chunks/.a.json.x1y2.tmp": b"{", ".chunks/KEY/c.json": b"mine",
                             ".chunks/notes.json": b"mine", "figures/b.png": b"mine"}


def test_a_ledger_is_never_written_through_a_link_nor_outside_the_folder(tmp_path):
    out = tmp_path / "run"
    io.mark_resumable(str(out), "sweep", {}, files=[], folders=[])
    with pytest.raises(ValueError, match="not a relative path"):
        io.claim(str(out), "../x")
    (tmp_path / "elsewhere").write_text("theirs")
    assert os.listdir(out) == [io.MARKER]
    io.claim(str(out), "a.txt")
    ledger = next(n for n in os.listdir(out) if n.startswith(io.LEDGER))
    os.unlink(out / ledger)
    os.symlink(tmp_path / "elsewhere", out / ledger)
    with pytest.raises(OSError):
        io.claim(str(out), "b.txt")
    assert (tmp_path / "elsewhere").read_text() == "theirs"
    assert io.claim(str(tmp_path / "unmarked"), "a.txt") == str(tmp_path / "unmarked" / "a.txt")
    assert not (tmp_path / "unmarked").exists()                      # no marker: nothing listed, nothing made


def test_reproduce_lists_its_chunks_and_figures_and_clear_keeps_a_users_file(tmp_path):
    from powerlens._src import reproduce
    from powerlens._src.sweeps.store import ChunkFolder
    out = tmp_path / "r"
    settings = {"quick": True, "seed": 0, "models": [], "sections": ["tiny"]}
    reproduce.prepare_folder(str(out), settings, overwrite=False)
    store = ChunkFolder(str(out), settings)
    ctx = reproduce.Context(out=str(out), store=store, quick=True, seed=0, models=[])
    store.cached("s1", lambda: {"x": 1})
    with open(ctx.fig("s1.png"), "wb") as fh:
        fh.write(b"png")
    assert list(io.foreign_entries(str(out))) == []
    (out / "figures" / "mine.png").write_text("mine")
    mine = os.path.join(store.root, "mine.txt")
    with open(mine, "w") as fh:
        fh.write("mine")
    with pytest.raises(ValueError, match=r"'\.chunks/[0-9a-f]{16}/mine\.txt' was not written by powerlens"):
        reproduce.prepare_folder(str(out), {**settings, "seed": 1}, overwrite=True)
    store.clear()                                                     # a finished run drops its chunks ...
    assert os.listdir(store.root) == ["mine.txt"]                    # ... and only those
    os.unlink(mine)
    os.unlink(out / "figures" / "mine.png")
    reproduce.prepare_folder(str(out), {**settings, "seed": 1}, overwrite=True)
    assert sorted(os.listdir(out)) == [io.MARKER]                     # the old run's files all removed


# ------------------------------------------------------------------ 4. staging folders

def test_only_folders_with_powerlens_staging_marker_are_removed(tmp_path, capsys):
    mine = tmp_path / ".E.partial-mine"
    mine.mkdir()
    (mine / "data.txt").write_text("mine")
    old_mine = tmp_path / ".E.old-mine" / "E"
    old_mine.mkdir(parents=True)
    (old_mine / "data.txt").write_text("mine")
    stale = tmp_path / ".E.partial-k1ll3d"                             # a killed run's: marked as powerlens's
    stale.mkdir()
    (stale / io.STAGE_MARKER).write_text(io.STAGE_TEXT)
    (stale / "states.npy").write_bytes(b"0" * 100)
    forged = tmp_path / ".E.partial-forged"                            # a marker with other content: not ours
    forged.mkdir()
    (forged / io.STAGE_MARKER).write_text("mine")
    before = snapshot(tmp_path)
    code, err = run(capsys, *FAST, "--out", tmp_path / "E")
    assert code == 0, err
    after = snapshot(tmp_path)
    assert not stale.exists()
    for rel, content in before.items():
        if not rel.startswith(".E.partial-k1ll3d"):
            assert after[rel] == content, rel
    assert not any(io.STAGE_MARKER in rel for rel in after if rel.startswith("E"))
    assert io.STAGE_MARKER not in io.read_marker(str(tmp_path / "E"))["files"]


def test_a_stage_carries_the_staging_marker_while_the_run_writes(tmp_path):
    with io.output_dir(str(tmp_path / "E"), command="simulate") as stage:
        with open(os.path.join(stage, io.STAGE_MARKER)) as fh:
            assert fh.read() == io.STAGE_TEXT
        io.write_text(os.path.join(stage, "a.txt"), "x")
    assert sorted(os.listdir(tmp_path / "E")) == sorted([io.MARKER, "a.txt"])
    assert io.read_marker(str(tmp_path / "E"))["files"] == ["a.txt"]


# ------------------------------------------------------------------ 6 and 12. damaged and forged chunks

def _rows_checksum(value):
    blob = json.dumps({"system": value["system"], "columns": value["columns"]}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def test_a_chunk_with_a_nan_literal_or_a_forged_column_is_named_and_recomputed(tmp_path, capsys):
    from powerlens._src.sweeps.api import sweep
    out = str(tmp_path / "a")
    quiet = dict(progress=False, report_files=False)
    ref = sweep(SWEEP, out=out, **quiet)
    capsys.readouterr()
    path = os.path.join(out, ".chunks", "g000-c000001.json")
    good = open(path).read()

    def resume(edit, why):
        value = json.loads(good)
        edit(value)
        if why.startswith("holds"):                                   # a forger recomputes the checksum
            value["provenance"]["rows"] = _rows_checksum(value)
        with open(path, "w") as fh:
            fh.write(json.dumps(value))
        again = sweep(SWEEP, out=out, **quiet)
        assert again.equals(ref)
        err = capsys.readouterr().err
        assert "g000-c000001" in err and why in err, err
        assert open(path).read() != json.dumps(value)                 # recomputed and rewritten

    resume(lambda v: v["columns"]["final_gamma"].__setitem__(0, float("nan")), "it holds NaN")
    resume(lambda v: v["columns"]["final_gamma"].__setitem__(0, float("inf")), "it holds Infinity")
    resume(lambda v: v["columns"].__setitem__("forged", [1] * len(v["system"])),
           "holds columns this sweep does not make (forged)")
    resume(lambda v: v["columns"]["final_gamma"].__setitem__(0, "x"),
           "holds a value that is not a number in column final_gamma")
    value = json.loads(good)                                          # 1e999: JSON that parses as an infinity
    value["columns"]["final_gamma"][0] = 12345.5
    with open(path, "w") as fh:
        fh.write(json.dumps(value).replace("12345.5", "1e999"))
    again = sweep(SWEEP, out=out, **quiet)
    assert again.equals(ref) and "holds a NaN or infinite value" in capsys.readouterr().err
    sweep(SWEEP, out=out, **quiet)                                    # now it matches: nothing said
    assert "g000-c000001" not in capsys.readouterr().err


def test_a_damaged_reproduce_chunk_is_named_once_and_recomputed(tmp_path):
    from powerlens._src.sweeps.store import ChunkFolder
    said = []
    store = ChunkFolder(str(tmp_path), {"seed": 0}, log=said.append)
    store.cached("s1", lambda: {"x": None})
    with open(store.path("s1"), "w") as fh:
        fh.write('{"x": NaN}')
    assert store.cached("s1", lambda: {"x": 2.0}) == {"x": 2.0}
    assert len(said) == 1 and "stored chunk s1" in said[0] and store.path("s1") in said[0] and "NaN" in said[0]
    assert json.loads(open(store.path("s1")).read()) == {"x": 2.0}


# ------------------------------------------------------------------ 11. the checkpoint's identity

def _safetensors(path, data: bytes):
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}).encode()
    with open(path, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header + data)


def test_a_checkpoint_with_other_weights_and_a_restored_mtime_is_another_checkpoint(tmp_path, monkeypatch):
    from powerlens._src.sweeps import provenance as systems
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "bert"}')
    weights = ckpt / "model.safetensors"
    _safetensors(weights, bytes(range(256)) * 40)
    first = systems.checkpoint_identity(str(ckpt))
    st = os.stat(weights)
    _safetensors(weights, bytes(range(255, -1, -1)) * 40)              # same shapes, other tensor data
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))            # the recorded mtime restored
    second = systems.checkpoint_identity(str(ckpt))
    assert first["model.safetensors"]["size"] == second["model.safetensors"]["size"]
    assert first["model.safetensors"]["mtime_ns"] == second["model.safetensors"]["mtime_ns"]
    assert first["model.safetensors"] != second["model.safetensors"]
    assert first["config.json"] == second["config.json"]
    # every byte is hashed (the sha256 of the whole file), in blocks of at most HASH_BLOCK bytes
    monkeypatch.setattr(systems, "HASH_BLOCK", 1000)
    reads = []
    ident = systems._file_identity(str(weights), reads.append)
    assert ident["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert max(reads) <= 1000 and sum(reads) == os.path.getsize(weights)


def test_files_written_by_another_process_during_the_scan_are_not_foreign(tmp_path, monkeypatch):
    """Process 0 of a sweep may list and write files while another process checks the folder:
    a ledger, a chunk folder and a chunk that appear between the lists' read and the folder's
    scan are powerlens's (each was listed before it was written), not the user's; a user's file
    that appears then is still foreign."""
    out = tmp_path / "out"
    out.mkdir()
    io.mark_resumable(str(out), "sweep", {"spec": {}}, files=["results.parquet"], folders=[".chunks"])
    real = io.Contents.read
    calls = []

    def read_then_write(folder):
        got = real(folder)
        if not calls:                                   # between the first read and the scan
            io.claim(folder, ".chunks/KEY/")
            (out / ".chunks" / "KEY").mkdir(parents=True)
            io.write_text(io.claim(folder, ".chunks/KEY/c0.json"), "{}")
        calls.append(folder)
        return got

    monkeypatch.setattr(io.Contents, "read", staticmethod(read_then_write))
    assert list(io.foreign_entries(str(out))) == []
    calls.clear()
    monkeypatch.setattr(io.Contents, "read", staticmethod(real))
    (out / "notes.txt").write_text("mine")
    assert list(io.foreign_entries(str(out))) == ["notes.txt"]
