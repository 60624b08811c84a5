"""Atomic checkpoint writes and the refusal of a checkpoint written under another config."""
import os
import re

import pytest
import torch

from pml_hyperbolic.training.checkpoint import CheckpointManager, atomic_torch_save, check_compatible, read_checkpoint
from pml_hyperbolic.training.config import ConfigError, config_fingerprint


def test_atomic_save_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "last.pt"
    atomic_torch_save({"v": 1}, str(path))
    atomic_torch_save({"v": 2}, str(path))
    assert read_checkpoint(str(path))["v"] == 2
    assert os.listdir(tmp_path) == ["last.pt"]


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    atomic_torch_save({"v": 1}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"v": Unpicklable()}, str(path))
    assert read_checkpoint(str(path))["v"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]


def test_different_config_is_refused_with_the_differing_keys():
    saved = {"lr": 3e-5, "batch_size": 294, "epochs": 5}
    ckpt = {"config_fingerprint": config_fingerprint(saved)}
    check_compatible(ckpt, {"lr": 3e-5, "batch_size": 294, "epochs": 9}, "x.pt")  # epochs may change
    with pytest.raises(ConfigError) as err:
        check_compatible(ckpt, {"lr": 1e-4, "batch_size": 294, "epochs": 5}, "x.pt")
    msg = str(err.value)
    assert "lr" in msg and "different configuration" in msg and "--output-dir" in msg


def test_a_flag_added_after_the_checkpoint_resumes_at_its_default_only():
    """A checkpoint from before a flag existed resumes when the run leaves the flag at its default
    (the behaviour it was added with); a value other than the default, or no defaults given, is refused."""
    ckpt = {"config_fingerprint": config_fingerprint({"lr": 3e-5, "levels": [512]})}
    defaults = {"lr": 1e-3, "levels": None, "ms_beta": 50.0, "steps": (3, 15)}
    check_compatible(ckpt, {"lr": 3e-5, "levels": [512], "ms_beta": 50.0, "steps": [3, 15]}, "x.pt", defaults)
    for changed in ({"ms_beta": 20.0}, {"steps": [3, 16]}):
        with pytest.raises(ConfigError, match=next(iter(changed))):
            check_compatible(ckpt, {"lr": 3e-5, "levels": [512], "ms_beta": 50.0, "steps": [3, 15], **changed},
                             "x.pt", defaults)
    with pytest.raises(ConfigError, match="ms_beta"):
        check_compatible(ckpt, {"lr": 3e-5, "levels": [512], "ms_beta": 50.0}, "x.pt")
    with pytest.raises(ConfigError, match="lr"):  # a recorded setting must still match, default or not
        check_compatible(ckpt, {"lr": 1e-3, "levels": [512], "ms_beta": 50.0}, "x.pt", defaults)


def test_flag_defaults_lists_every_flag_with_a_default():
    import argparse

    from pml_hyperbolic.training.config import flag_defaults

    parser = argparse.ArgumentParser()
    parser.add_argument("--ms-beta", type=float, default=50.0)
    parser.add_argument("--levels", type=int, nargs="+", default=None)
    parser.add_argument("--quiet", action="store_true")
    assert flag_defaults(parser) == {"ms_beta": 50.0, "levels": None, "quiet": False}


def test_resume_without_checkpoint_says_what_to_do(tmp_path):
    manager = CheckpointManager(str(tmp_path), {})
    with pytest.raises(ConfigError, match="drop --resume"):
        manager.resolve("auto")


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(ConfigError, match="not a pml-hyperbolic"):
        CheckpointManager(str(tmp_path), {}).load(str(path))


def test_flipped_bytes_inside_the_tensor_data_are_refused(tmp_path):
    # torch's zip reader checks no CRC: without the digest this checkpoint would load silently
    path = tmp_path / "last.pt"
    weights = torch.arange(4096, dtype=torch.float32)
    atomic_torch_save({"w": weights, "epoch": 3}, str(path))
    assert torch.equal(read_checkpoint(str(path))["w"], weights)
    data = bytearray(path.read_bytes())
    marker = weights[1000:1004].numpy().tobytes()  # bytes of the tensor inside the payload
    at = bytes(data).find(marker)
    assert at > 0
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupted.*SHA-256"):
        read_checkpoint(str(path))
    manager = CheckpointManager(str(tmp_path), {})
    with pytest.raises(ConfigError, match="corrupted"):
        manager.load(str(path))


def test_checkpoint_without_digest_still_loads(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"v": 7}, path)  # written before digests existed
    assert read_checkpoint(str(path)) == {"v": 7}


@pytest.mark.parametrize("reason", ["No space left on device", "unexpected pos 64 vs 0 (disk full?)"])
def test_disk_full_is_one_clear_error_and_the_old_checkpoint_survives(tmp_path, monkeypatch, reason):
    import errno

    manager = CheckpointManager(str(tmp_path), {})
    atomic_torch_save({"epoch": 1}, manager.last_path)

    class Trainer:
        pass

    monkeypatch.setattr(manager, "state", lambda *a: {"epoch": 2})

    def full_disk(*args, **kwargs):
        if reason.startswith("No space"):
            raise OSError(errno.ENOSPC, reason)
        raise RuntimeError("unexpected pos 64 vs 0")  # torch's zip writer on a full disk

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(ConfigError, match=f"cannot write checkpoint .*{re.escape(reason)}.*intact"):
        manager.save(Trainer(), 2, {}, [], is_best=False)
    monkeypatch.undo()
    assert read_checkpoint(manager.last_path) == {"epoch": 1}
    assert os.listdir(tmp_path) == ["last.pt"]


def test_packed_state_is_written_as_it_is_and_a_raw_dict_is_refused(tmp_path):
    from pml_hyperbolic.training.checkpoint import pack_with_digest

    packed = pack_with_digest({"v": torch.arange(3)})
    for name in ("last.pt", "best.pt"):  # one serialisation, two files (CheckpointManager.save)
        atomic_torch_save(packed, str(tmp_path / name), packed=True)
        assert torch.equal(read_checkpoint(str(tmp_path / name))["v"], torch.arange(3))
    assert (tmp_path / "last.pt").read_bytes() == (tmp_path / "best.pt").read_bytes()
    with pytest.raises(ValueError, match="pack_with_digest"):
        atomic_torch_save({"v": 1}, str(tmp_path / "x.pt"), packed=True)
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]


def test_ctrl_c_during_a_checkpoint_write_waits_for_the_file(tmp_path, monkeypatch):
    """A SIGINT raised inside torch.save used to surface as torch's zip-writer RuntimeError (exit 1):
    now the write completes and the KeyboardInterrupt follows it."""
    import os
    import signal

    import pml_hyperbolic.training.checkpoint as ckpt

    real_save = torch.save
    calls = []

    def save_interrupted_midway(obj, f, *args, **kwargs):
        calls.append(1)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the file is being written
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_interrupted_midway)
    path = tmp_path / "last.pt"
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"v": torch.arange(4)}, str(path))
    assert len(calls) == 2  # the digest's serialisation and the file's
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert torch.equal(read_checkpoint(str(path))["v"], torch.arange(4))  # complete, not a half-written file
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_ctrl_c_deferred_respects_an_ignored_sigint_and_nesting():
    import os
    import signal

    from pml_hyperbolic.training.checkpoint import ctrl_c_deferred

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # ignored before: still ignored, no raise
    finally:
        signal.signal(signal.SIGINT, previous)
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_deferred():
            with ctrl_c_deferred():  # nested: the inner block does not raise early
                os.kill(os.getpid(), signal.SIGINT)
            reached = True
    assert reached


class _Payload:
    """Unpickling it would create a marker file: a stand-in for any code a crafted checkpoint runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted_files(tmp_path, marker):
    """Checkpoints whose unpickling would run code: inside the digested payload (a valid digest: the
    digest protects against damage, not against whoever writes the file), as a whole file without a
    digest, and inside the outer container itself."""
    import io

    from pml_hyperbolic.training.checkpoint import CHECKPOINT_FORMAT, _sha256, pack_with_digest

    evil = {"epoch": 1, "config_fingerprint": {}, "x": _Payload(marker)}
    inner = tmp_path / "inner.pt"
    atomic_torch_save(evil, str(inner))
    whole = tmp_path / "whole.pt"
    torch.save(evil, whole)
    outer = tmp_path / "outer.pt"
    packed = pack_with_digest({"epoch": 1})
    torch.save({**packed, "extra": _Payload(marker)}, outer, pickle_protocol=4)
    buffer = io.BytesIO()
    torch.save(evil, buffer, pickle_protocol=4)  # the raw protocol the container uses
    raw = tmp_path / "raw4.pt"
    payload = buffer.getvalue()
    torch.save({"format": CHECKPOINT_FORMAT, "sha256": _sha256(payload), "payload": payload}, raw, pickle_protocol=4)
    return [inner, whole, outer, raw]


def test_crafted_checkpoint_never_runs_its_code(tmp_path):
    from pml_hyperbolic.training.checkpoint import unpack_with_digest

    marker = tmp_path / "marker"
    files = _crafted_files(tmp_path, marker)
    assert not marker.exists()
    manager = CheckpointManager(str(tmp_path), {})
    for path in files:
        for load in (read_checkpoint, manager.load):
            with pytest.raises(ConfigError) as err:
                load(str(path))
            message = str(err.value)
            assert str(path) in message and "refused" in message and "\n" not in message
            assert "Weights only" not in message and "pickle" not in message.lower()
            assert not marker.exists(), (load, path)
    # the digest-unpacking step alone refuses it too
    from pml_hyperbolic.training.checkpoint import _read_container

    packed = _read_container(str(files[0]))
    with pytest.raises(ConfigError, match="refused"):
        unpack_with_digest(packed, str(files[0]))
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x00" * 10, bytes(range(256)) * 40, b"PK\x03\x04garbage"])
def test_garbage_file_is_one_clear_error_naming_it(tmp_path, content):
    path = tmp_path / "last.pt"
    path.write_bytes(content)
    for load in (read_checkpoint, CheckpointManager(str(tmp_path), {}).load):
        with pytest.raises(ConfigError) as err:
            load(str(path))
        message = str(err.value)
        assert str(path) in message and "\n" not in message
        assert "pickle" not in message.lower() and "Weights only" not in message


def test_truncated_checkpoint_is_one_clear_error(tmp_path):
    path = tmp_path / "last.pt"
    atomic_torch_save({"w": torch.arange(10000.0)}, str(path))
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ConfigError, match=f"cannot read checkpoint {path}"):
        read_checkpoint(str(path))


def test_rng_state_round_trips_through_the_restricted_loader(tmp_path):
    import random

    import numpy as np

    from pml_hyperbolic.training.checkpoint import rng_state, set_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian half in numpy's state
    path = tmp_path / "rng.pt"
    atomic_torch_save({"rng": rng_state()}, str(path))
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(read_checkpoint(str(path))["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_checkpoint_with_a_numpy_rng_array_still_loads(tmp_path):
    # checkpoints written before the NumPy state was stored as plain ints hold a uint32 array
    import numpy as np

    from pml_hyperbolic.training.checkpoint import set_rng_state

    path = tmp_path / "old.pt"
    atomic_torch_save({"rng": {"python": __import__("random").getstate(), "numpy": np.random.get_state(),
                               "torch": torch.get_rng_state()}}, str(path))
    state = read_checkpoint(str(path))["rng"]
    assert isinstance(state["numpy"][1], np.ndarray)
    set_rng_state(state)
