"""Files radixkv writes and then trusts: the native library is loaded only from a folder of this
user's that no one else may write; converted weights are as private as their source; a failed
write leaves no temporary file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixkv.cpu.native import check_private
from radixkv.model import loader
from radixkv.model.loader import CONVERTED_MARKER, keep_mode_of
from tests.helpers.tiny_models import make_tiny_model


def library_in(folder: Path, folder_mode: int, file_mode: int) -> Path:
    folder.mkdir()
    library = folder / "radixkv-test.so"
    library.write_bytes(b"\x7fELF")
    os.chmod(library, file_mode)
    os.chmod(folder, folder_mode)
    return library


def test_a_library_in_a_private_folder_is_trusted(tmp_path):
    check_private(library_in(tmp_path / "native", 0o755, 0o755))


@pytest.mark.parametrize("folder_mode, file_mode", [(0o777, 0o755), (0o775, 0o755), (0o755, 0o666), (0o755, 0o775)])
def test_a_library_others_may_write_is_refused(tmp_path, folder_mode, file_mode):
    with pytest.raises(PermissionError, match="writable by others"):
        check_private(library_in(tmp_path / "native", folder_mode, file_mode))


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
def test_a_library_of_another_user_is_refused(tmp_path):
    library = library_in(tmp_path / "theirs", 0o755, 0o755)
    os.chown(library, 65534, 65534)  # nobody
    with pytest.raises(PermissionError, match="belongs to uid"):
        check_private(library)


@pytest.mark.parametrize("source_mode, file_mode, folder_mode", [(0o600, 0o600, 0o700), (0o644, 0o644, 0o755), (0o640, 0o640, 0o750)])
def test_a_converted_folder_keeps_its_source_permissions(tmp_path, source_mode, file_mode, folder_mode):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    os.chmod(source, source_mode)
    folder = tmp_path / "converted"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "sub" / "tokenizer.json").write_text("{}")
    keep_mode_of(source, folder)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == file_mode
    assert (folder / "sub" / "tokenizer.json").stat().st_mode & 0o777 == file_mode
    assert folder.stat().st_mode & 0o777 == folder_mode and (folder / "sub").stat().st_mode & 0o777 == folder_mode


@pytest.fixture()
def converted_folder(tmp_path) -> Path:
    """A tiny model dressed as one of radixkv's converted folders, its weights private."""
    folder = make_tiny_model(tmp_path / "converted", "llama", max_position_embeddings=64)
    (folder / CONVERTED_MARKER).write_text("{}\n")
    os.chmod(folder / "model.safetensors", 0o600)
    return folder


def test_the_cast_copy_is_as_private_as_the_converted_weights(converted_folder):
    loader._weights_for(converted_folder, torch.bfloat16, torch.device("cpu"))
    cast = converted_folder / "model.bfloat16.safetensors"
    assert cast.is_file() and cast.stat().st_mode & 0o777 == 0o600


def test_a_failed_cast_copy_leaves_no_temporary_file(converted_folder, monkeypatch):
    import safetensors.torch

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        loader._weights_for(converted_folder, torch.bfloat16, torch.device("cpu"))
    assert sorted(p.name for p in converted_folder.iterdir() if ".tmp-" in p.name) == []
    assert not (converted_folder / "model.bfloat16.safetensors").exists()


def test_a_failed_conversion_leaves_no_temporary_folder(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)  # a header and nothing usable after it
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever transformers raises for it
        loader.gguf_folder(gguf, str(cache))
    assert [p.name for p in cache.iterdir()] == []
