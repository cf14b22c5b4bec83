"""Where a compiled CPU extension is built: one build per content, whatever the sources'
folder, so a Ray job's uploaded copy of the code loads the build ``make setup`` made."""

from __future__ import annotations

import shutil

from kernels import cpu_build
from kernels.cpu_build import CompiledExtension
from kernels.layer_ops_cpu import EXTENSION


def copy_of(extension: CompiledExtension, folder) -> CompiledExtension:
    folder.mkdir()
    for path in extension.sources + extension.headers:
        shutil.copy(path, folder / path.name)
    return CompiledExtension(
        extension.name,
        [folder / p.name for p in extension.sources],
        [folder / p.name for p in extension.headers],
        switch=extension.switch,
    )


def test_a_copy_of_the_sources_elsewhere_names_the_same_build(tmp_path):
    elsewhere = copy_of(EXTENSION, tmp_path / "uploaded")
    assert elsewhere.build_directory() == EXTENSION.build_directory()


def test_other_source_bytes_name_another_build(tmp_path):
    changed = copy_of(EXTENSION, tmp_path / "changed")
    with open(changed.headers[0], "a") as f:
        f.write("\n// another build\n")
    assert changed.build_name() != EXTENSION.build_name()


def test_the_build_compiles_copies_inside_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    extension = copy_of(EXTENSION, tmp_path / "checkout")
    folder = extension.build_directory() / "src"
    staged = extension._stage_sources(folder)
    assert [p.parent for p in staged] == [folder]
    assert all((folder / p.name).read_bytes() == p.read_bytes() for p in extension.headers)
    before = [p.stat().st_mtime_ns for p in staged]
    extension._stage_sources(folder)  # unchanged copies keep the timestamps ninja compares
    assert [p.stat().st_mtime_ns for p in staged] == before


def test_builds_live_in_the_users_cache_unless_torch_is_told(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cpu_build.build_root() == tmp_path / "cache" / "meridian-kernels"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert cpu_build.build_root() == tmp_path / "torch"


def test_a_complete_build_is_imported_without_compiling(tmp_path, monkeypatch):
    """Another checkout (another virtual environment: torch's ninja file would differ in its
    include paths) imports the complete build's library; nothing is compiled."""
    import torch.utils.cpp_extension

    assert EXTENSION.load() is not None, EXTENSION.error()  # built by `make setup`
    assert (EXTENSION.build_directory() / cpu_build.COMPLETE).exists()

    def no_compiling(**kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiling)
    elsewhere = copy_of(EXTENSION, tmp_path / "clone")
    module = elsewhere.load()
    assert module is not None, elsewhere.error()
    assert module.__file__ == str(EXTENSION.build_directory() / f"{elsewhere.build_name()}.so")
