"""The run folder under stress: folders that cannot be written, a disk that fills up mid-run,
--overwrite that keeps the previous run until the new one completes, and --resume given a file that
is no checkpoint. Each mistake is one ``error:`` line on stderr, never a traceback."""
import errno
import io
import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.recipes.test_recipe_end_to_end import RECIPES, TINY, load_recipe

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PML_HYPERBOLIC_")}
QUICK = TINY + ["--no-plots", "--eval-before", "false"]
TWO_EPOCHS = [a if i == 0 or QUICK[i - 1] != "--epochs" else "2" for i, a in enumerate(QUICK)]


def error_line(err):
    """The single ``error:`` line of stderr (no traceback)."""
    lines = [line for line in err.strip().splitlines() if line]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def main_fails(recipe_cls, argv, capsys, code=2):
    with pytest.raises(SystemExit) as exit_info:
        recipe_cls.main(argv)
    assert exit_info.value.code == code, capsys.readouterr().err
    return error_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def HypViT():
    return load_recipe("hyp_vit").HypViT


# ---- folders that cannot be written: refused before anything is loaded ----
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_output_dir_under_proc_is_one_line(HypViT, capsys):
    line = main_fails(HypViT, ["--output-dir", "/proc/no-such-pml-run/run"], capsys)
    assert "/proc/no-such-pml-run/run" in line and "cannot create a folder in /proc" in line
    assert not os.path.exists("/proc/no-such-pml-run")


def test_read_only_folder_is_refused_before_the_run(HypViT, tmp_path, capsys, monkeypatch):
    """A folder whose permission bits look writable but refuses writes (a read-only mount; root
    under /proc): the check tries to create something there."""
    import pml_hyperbolic.training.cli as cli

    parent = tmp_path / "mounted"
    parent.mkdir()
    real_mkdtemp = cli.tempfile.mkdtemp

    def read_only_mkdtemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == str(parent):
            raise OSError(errno.EROFS, "Read-only file system", dir)
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(cli.tempfile, "mkdtemp", read_only_mkdtemp)
    line = main_fails(HypViT, QUICK + ["--output-dir", str(parent / "run")], capsys)
    assert str(parent) in line and "Read-only file system" in line
    assert os.listdir(parent) == []


def test_resumed_run_with_a_read_only_log_is_refused(HypViT, tmp_path, capsys, monkeypatch):
    import pml_hyperbolic.training.cli as cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "log.csv").write_text("epoch\n1\n")
    (run / "last.pt").write_bytes(_zip_bytes())
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False if str(path) == str(run / "log.csv") else
                        real_access(path, mode))
    line = main_fails(HypViT, QUICK + ["--output-dir", str(run), "--resume"], capsys)
    assert f"{run / 'log.csv'} is not writable" in line


def test_a_write_that_fails_during_the_run_is_one_line_naming_the_file(HypViT, tmp_path, capsys, monkeypatch):
    """The folder became read-only (or full) after the checks: exit status 1, one line, no traceback."""
    import builtins

    import pml_hyperbolic.training.run_logger as run_logger

    run = tmp_path / "run"

    def failing_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("log.csv") and "a" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_logger, "open", failing_open, raising=False)
    line = main_fails(HypViT, QUICK + ["--output-dir", str(run)], capsys, code=1)
    assert line == (f"error: cannot write {run / 'log.csv'}: Read-only file system. Free space or make the folder "
                    "writable, or choose another --output-dir.")


def test_run_logger_write_failures_name_the_file(tmp_path, monkeypatch):
    from pml_hyperbolic.training.config import RunWriteError
    from pml_hyperbolic.training.run_logger import RunLogger

    logger = RunLogger(str(tmp_path), tensorboard=False)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    import pml_hyperbolic.training.run_logger as run_logger

    monkeypatch.setattr(run_logger.json, "dump", full_disk)
    with pytest.raises(RunWriteError, match="results.json: No space left on device"):
        logger.write_json("results.json", {"a": 1})
    assert os.listdir(tmp_path) == []  # no half-written results.json.tmp left behind
    with pytest.raises(RunWriteError, match="cannot write /proc/"):
        RunLogger("/proc/no-such-pml-run", tensorboard=False)


# ---- a full disk while a checkpoint is written ----
@pytest.mark.parametrize("failure", [RuntimeError("unexpected pos 64 vs 0"),
                                     OSError(errno.ENOSPC, "No space left on device")], ids=["torch", "oserror"])
def test_full_disk_at_a_checkpoint_keeps_the_previous_one(HypViT, tmp_path, capsys, monkeypatch, failure):
    """torch's zip writer reports a full disk as ``RuntimeError: unexpected pos ...``: one line naming
    the checkpoint (exit status 1), and epoch 1's last.pt stays complete and resumable."""
    import pml_hyperbolic.training.checkpoint as checkpoint

    real_save = checkpoint.torch.save
    file_writes = []

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, io.BytesIO):  # a file: the first goes through, then the disk is full
            file_writes.append(f)
            if len(file_writes) > 2:  # epoch 1 wrote last.pt and best.pt
                if hasattr(f, "write"):
                    f.write(b"PK\x03\x04 partial")
                raise failure
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    run = tmp_path / "run"
    line = main_fails(HypViT, TWO_EPOCHS + ["--eval-every", "1", "--output-dir", str(run)], capsys, code=1)
    assert f"cannot write checkpoint {run / 'last.pt'}" in line
    assert ("unexpected pos 64 vs 0 (disk full?)" if isinstance(failure, RuntimeError)
            else "No space left on device") in line
    assert "previous checkpoint there is intact" in line
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert checkpoint.read_checkpoint(str(run / "last.pt"))["epoch"] == 1
    assert not [name for name in os.listdir(run) if name.startswith(".tmp-")]


# ---- --overwrite keeps the previous run until the new one completes ----
OLD_RUN = {"last.pt": "old checkpoint", "best.pt": "old best", "log.csv": "epoch\n1\n2\n3\n",
           "results.json": json.dumps({"after": {"recall_at_1": 0.5}}), "config.json": "{\"old\": true}",
           "poincare_disk.png": "old plot", "my_notes.txt": "not a run file"}


def old_run(folder):
    folder.mkdir()
    for name, text in OLD_RUN.items():
        (folder / name).write_text(text)
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events").write_text("old events")


def assert_old_run(folder):
    assert sorted(os.listdir(folder)) == sorted([*OLD_RUN, "tensorboard"])
    assert all((folder / name).read_text() == text for name, text in OLD_RUN.items())
    assert (folder / "tensorboard" / "events").read_text() == "old events"


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "error"], ids=["ctrl-c", "error"])
def test_overwrite_that_stops_before_its_first_checkpoint_puts_the_previous_run_back(HypViT, tmp_path, capsys, stop):
    from pml_hyperbolic.training.cli import backup_folder
    from pml_hyperbolic.training.config import ConfigError

    run = tmp_path / "run"
    old_run(run)

    class Stopping(HypViT):
        def build_loss(self):
            assert not (run / "last.pt").exists()  # the old run is aside while the new one starts
            assert (tmp_path / "run.previous" / "last.pt").read_text() == "old checkpoint"
            if stop is KeyboardInterrupt:
                raise KeyboardInterrupt
            raise ConfigError("stopped for the test")

    with pytest.raises(SystemExit) as exit_info:
        Stopping.main(QUICK + ["--output-dir", str(run), "--overwrite"])
    assert exit_info.value.code == (130 if stop is KeyboardInterrupt else 2)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "the previous run is back in" in captured.out
    assert_old_run(run)
    assert not os.path.exists(backup_folder(str(run)))


def test_overwrite_keeps_the_previous_run_until_the_new_one_completes(HypViT, tmp_path, capsys):
    run = tmp_path / "run"
    old_run(run)
    backup = tmp_path / "run.previous"
    # stopped after epoch 1 (as if interrupted): the new run has a checkpoint, the old one still waits
    HypViT.main(TWO_EPOCHS + ["--output-dir", str(run), "--overwrite", "--stop-after-epoch", "1"])
    assert (backup / "last.pt").read_text() == "old checkpoint" and (backup / "tensorboard" / "events").is_file()
    assert (run / "last.pt").read_bytes()[:2] == b"PK" and (run / "my_notes.txt").read_text() == "not a run file"
    from pml_hyperbolic.training.cli import interrupted_message

    assert f"stays in {backup}" in interrupted_message(str(run), [])
    # the resumed run completes: the backup goes
    HypViT.main(TWO_EPOCHS + ["--output-dir", str(run), "--resume"])
    assert not backup.exists()
    assert json.loads((run / "results.json").read_text())["epochs_completed"] == 2
    assert (run / "my_notes.txt").read_text() == "not a run file"


def test_overwrite_refuses_a_backup_folder_it_did_not_make(HypViT, tmp_path, capsys):
    run = tmp_path / "run"
    old_run(run)
    (tmp_path / "run.previous").mkdir()
    line = main_fails(HypViT, QUICK + ["--output-dir", str(run), "--overwrite"], capsys)
    assert str(tmp_path / "run.previous") in line and "Move it away" in line
    assert_old_run(run)


def test_overwrite_refuses_a_parent_folder_that_cannot_hold_the_backup(HypViT, tmp_path, capsys, monkeypatch):
    import pml_hyperbolic.training.cli as cli

    run = tmp_path / "run"
    old_run(run)
    real_mkdtemp = cli.tempfile.mkdtemp

    def read_only_parent(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == str(tmp_path):
            raise OSError(errno.EACCES, "Permission denied", dir)
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(cli.tempfile, "mkdtemp", read_only_parent)
    line = main_fails(HypViT, QUICK + ["--output-dir", str(run), "--overwrite"], capsys)
    assert f"{tmp_path} refuses it (Permission denied)" in line and str(tmp_path / "run.previous") in line
    assert_old_run(run)


# ---- --resume given something that is not a checkpoint ----
def _zip_bytes():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", "a zip archive, but not a checkpoint")
    return buffer.getvalue()


def test_garbage_resume_file_is_refused_before_torch_is_imported(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(1000))
    code = (f"import sys; sys.path.insert(0, {RECIPES!r}); import hyp_vit as m; "
            f"m.HypViT.main(['--output-dir', {str(tmp_path / 'run')!r}, '--resume', {str(garbage)!r}])")
    proc = subprocess.run([sys.executable, "-c", code + "; print('ran')"], capture_output=True, text=True,
                          timeout=120, env=CLEAN_ENV)
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert str(garbage) in line and "is not a checkpoint" in line
    assert not (tmp_path / "run").exists()
    check = (f"import sys; sys.path.insert(0, {RECIPES!r}); import hyp_vit as m\n"
             f"try:\n    m.HypViT.preflight(m.HypViT.parse(['--output-dir', {str(tmp_path / 'run')!r}, "
             f"'--resume', {str(garbage)!r}]))\nexcept ValueError:\n    pass\n"
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                          env=CLEAN_ENV).stdout.strip() == "False"


def test_zip_that_is_no_checkpoint_leaves_no_run_folder(HypViT, tmp_path, capsys):
    fake = tmp_path / "fake.pt"
    fake.write_bytes(_zip_bytes())
    line = main_fails(HypViT, QUICK + ["--output-dir", str(tmp_path / "run"), "--resume", str(fake)], capsys)
    assert str(fake) in line
    assert not (tmp_path / "run").exists()


def test_resume_from_another_recipes_checkpoint_is_one_line(HypViT, tmp_path, capsys):
    HypViT.main(QUICK + ["--output-dir", str(tmp_path / "vit")])
    capsys.readouterr()
    HypUML = load_recipe("hyp_uml_cars").HypUML
    line = main_fails(HypUML, QUICK + ["--output-dir", str(tmp_path / "uml"), "--resume",
                                       str(tmp_path / "vit" / "last.pt")], capsys)
    assert "different configuration" in line and "radial_calibration" in line and "Resume with" in line
    assert not (tmp_path / "uml").exists()
