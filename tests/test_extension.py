"""CPU tests of the extension build (gn_patch/extension.py, gn_patch/build.py): a failed build warns once and
falls back, a missing nvcc is one clear error, the sources are every .cpp/.cu of csrc wherever it is, a library
compiled at install time is used only where it fits, and (in CI) the kernels compile."""

import json
import os
import time
import warnings
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

from gn_patch import extension


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise extension.BuildError("nvcc not found (test)")

    monkeypatch.setattr(extension, "build", broken)
    monkeypatch.setattr(extension, "_loaded", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extension.kernels_available() is False
        assert extension.kernels_available() is False
    messages = [str(w.message) for w in caught if "gn_patch" in str(w.message)]
    assert len(messages) == 1 and "nvcc not found (test)" in messages[0]


def test_missing_nvcc_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(extension.Path, "exists", lambda self: False)
    with pytest.raises(extension.BuildError, match="nvcc not found"):
        extension._cuda_home()


@pytest.mark.skipif(not os.environ.get("GN_PATCH_REQUIRE_BUILD"),
                    reason="set GN_PATCH_REQUIRE_BUILD=1 (CI does; without a GPU also "
                           "TORCH_CUDA_ARCH_LIST=9.0) to require the CUDA extension to compile here")
def test_extension_compiles_and_loads():
    """CI has nvcc but no GPU: the kernels must still compile and the library load."""
    path = extension.build()
    assert path.exists()


def test_sources_are_every_cpp_and_cu_file(tmp_path):
    for name in ("b.cu", "a.cpp", "z.cpp", "common.cuh", "api.h", "notes.txt"):
        (tmp_path / name).write_text("")
    assert [p.name for p in extension.source_files(tmp_path)] == ["a.cpp", "z.cpp", "b.cu"]


def test_the_checkout_csrc_serves_an_editable_install():
    directory = extension.source_directory()
    assert directory == extension.PACKAGE_DIR.parent / "csrc"
    assert {p.name for p in extension.source_files(directory)} >= {"ops.cpp"}


def test_missing_sources_are_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(extension, "PACKAGE_DIR", tmp_path / "gn_patch")
    with pytest.raises(extension.BuildError, match="kernel sources are missing"):
        extension.source_directory()


@pytest.fixture
def prebuilt(monkeypatch, tmp_path):
    """A package folder holding a fake library compiled at install time and its sources (csrc/); returns a function
    writing the library's record."""
    monkeypatch.setattr(extension, "PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(extension, "PREBUILT_INFO", tmp_path / "gn_patch_C.json")
    library = tmp_path / f"gn_patch_C{EXTENSION_SUFFIXES[0]}"
    library.write_bytes(b"")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "ops.cpp").write_text("// ops\n")
    (tmp_path / "csrc" / "reduce.cuh").write_text("// reductions\n")

    def record(**changes):
        info = {"library": library.name, "torch": extension.torch.__version__, "cuda": extension.torch.version.cuda,
                "arch": "8.0;9.0+PTX", "sources": extension.sources_digest(tmp_path / "csrc")}
        extension.PREBUILT_INFO.write_text(json.dumps({**info, **changes}))
        return library

    return record


def test_prebuilt_library_is_used_where_it_fits(prebuilt, monkeypatch):
    library = prebuilt()
    assert extension.prebuilt_library("9.0") == library
    assert extension.prebuilt_library("8.0;9.0") == library
    if extension.torch.version.cuda is None:
        pytest.skip("build() needs a CUDA build of torch")
    loaded = []
    monkeypatch.setattr(extension.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(extension, "_load_entry", loaded.append)
    monkeypatch.setattr(extension, "_cuda_home", lambda: pytest.fail("a prebuilt library needs no toolkit"))
    assert extension.build("9.0") == library and loaded == [str(library), library]


def test_library_without_its_python_module_is_a_build_error(tmp_path, monkeypatch):
    """A library that cannot be imported as gn_patch's Python module (compiled from sources without
    csrc/python_entry.cpp) is a BuildError, which turns the kernels off with a warning, not an ImportError."""
    monkeypatch.setattr(extension, "entry", None)
    library = tmp_path / f"gn_patch_C{EXTENSION_SUFFIXES[0]}"
    library.write_bytes(b"")
    with pytest.raises(extension.BuildError, match="loaded, but not as gn_patch's Python module"):
        extension._load_entry(library)
    assert extension.entry is None


def test_loaded_library_is_its_python_module(ext):
    """The library the tests loaded is also the Python module whose function the op layer calls."""
    assert callable(extension.entry) and extension.entry.__module__ == "gn_patch.gn_patch_C"


@pytest.mark.parametrize("changes, arch", [({"torch": "0.0.1"}, "9.0"), ({"cuda": "1.0"}, "9.0"), ({}, "10.0")])
def test_prebuilt_library_for_another_setup_is_not_used(prebuilt, changes, arch):
    prebuilt(**changes)
    with pytest.warns(RuntimeWarning, match="compiling them for this setup instead"):
        assert extension.prebuilt_library(arch) is None


@pytest.mark.parametrize("edit", ["source", "header"])
def test_prebuilt_library_from_other_sources_is_not_used(prebuilt, tmp_path, edit):
    """A library compiled before the sources beside it changed (an editable install's, after a checkout) would lack
    their ops or kernels: it is compiled again from them instead."""
    prebuilt()
    (tmp_path / "csrc" / ("ops.cpp" if edit == "source" else "reduce.cuh")).write_text("// changed\n")
    with pytest.warns(RuntimeWarning, match="compiled from other sources"):
        assert extension.prebuilt_library("9.0") is None


@pytest.mark.parametrize("record", ["{not json", "[]", "null", '{"torch": "2.14.1"}', "arch_null", "\ufeff{}"])
def test_unreadable_record_is_one_warning(prebuilt, record):
    """A record that is not setup.py's (not JSON, not an object, missing or mistyped fields, one from before the
    digest) is not trusted."""
    prebuilt()
    text = (json.dumps({**json.loads(extension.PREBUILT_INFO.read_text()), "arch": None}) if record == "arch_null"
            else record)
    extension.PREBUILT_INFO.write_text(text)
    with pytest.warns(RuntimeWarning, match="not a readable record"):
        assert extension.prebuilt_library("9.0") is None


def test_editor_files_and_folders_among_the_sources_change_nothing(prebuilt, tmp_path):
    """An editor's lock file (a dangling hidden symlink), hidden backups and a folder named like a header neither
    break the digest nor count as sources."""
    library = prebuilt()
    csrc = tmp_path / "csrc"
    (csrc / ".#ops.cpp").symlink_to(tmp_path / "nowhere")
    (csrc / ".ops.cpp.swp.h").write_text("// backup\n")
    (csrc / "folder.h").mkdir()
    assert extension.prebuilt_library("9.0") == library
    assert [p.name for p in extension.source_files(csrc)] == ["ops.cpp"]


def test_the_record_names_its_library(prebuilt, tmp_path):
    """Libraries of other Python versions beside it are not the one the record describes."""
    prebuilt()
    other = tmp_path / "gn_patch_C.abi3.so"
    other.write_bytes(b"")
    record = json.loads(extension.PREBUILT_INFO.read_text())
    extension.PREBUILT_INFO.write_text(json.dumps({**record, "library": other.name}))
    assert extension.prebuilt_library("9.0") == other
    extension.PREBUILT_INFO.write_text(json.dumps({**record, "library": "gn_patch_C.cpython-0-x.so"}))
    assert extension.prebuilt_library("9.0") is None
    extension.PREBUILT_INFO.write_text(json.dumps({**record, "library": "../gn_patch_C.so"}))
    assert extension.prebuilt_library("9.0") is None


def test_unreadable_sources_are_not_matched(prebuilt, monkeypatch):
    prebuilt()

    def unreadable(directory):
        raise PermissionError(13, "Permission denied", str(directory / "ops.cpp"))

    monkeypatch.setattr(extension, "sources_digest", unreadable)
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert extension.prebuilt_library("9.0") is None


def test_prebuilt_library_without_sources_is_used(prebuilt, tmp_path):
    """Nothing to compile it from: the library is all there is."""
    library = prebuilt()
    for path in (tmp_path / "csrc").iterdir():
        path.unlink()
    assert extension.prebuilt_library("9.0") == library


def test_no_prebuilt_library_without_its_record(prebuilt):
    prebuilt()
    extension.PREBUILT_INFO.unlink()
    assert extension.prebuilt_library("9.0") is None


def test_build_messages_where_a_compile_comes(tmp_path):
    """build() prints its lines around a compile: no library yet, a build directory last used by another
    checkout's sources (the directory is shared per torch, CUDA and arch), or a source or header newer than the
    library; not where ninja finds the library up to date."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    sources = [csrc / "ops.cpp", csrc / "forward_silu.cu"]
    for path in [*sources, csrc / "common.cuh"]:
        path.write_text("")
    library = tmp_path / "build" / "gn_patch_C.so"
    library.parent.mkdir()
    assert extension._compiles(library, sources)
    library.write_text("")
    (library.parent / "build.ninja").write_text(" ".join(str(p) for p in sources))
    past = library.stat().st_mtime - 100
    for path in csrc.iterdir():
        os.utime(path, (past, past))
    assert not extension._compiles(library, sources)
    other = [tmp_path / "other" / path.name for path in sources]
    assert extension._compiles(library, other)
    os.utime(csrc / "common.cuh")  # now: newer than the library
    assert extension._compiles(library, sources)


posix_only = pytest.mark.skipif(os.name != "posix", reason="the build lock is POSIX's flock")


def holds_lock(directory) -> bool:
    """Whether some open file holds gn_patch's build lock of ``directory`` (a second open file description cannot
    take it without waiting)."""
    import fcntl

    with open(directory / "gn_patch.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@posix_only
@pytest.mark.parametrize("file_baton", [True, False], ids=["torch<=2.13", "torch>=2.14"])
def test_build_lock_excludes_other_builds_and_clears_a_stale_torch_lock(tmp_path, monkeypatch, file_baton):
    """A killed build of torch 2.13 or older leaves cpp_extension's `lock`, on which every later load waits: under
    gn_patch's lock no other build runs, so it is removed there. torch 2.14's `lock` is an OS lock, left alone."""
    from torch.utils import cpp_extension

    if file_baton:
        monkeypatch.setattr(cpp_extension, "FileBaton", object, raising=False)
    else:
        monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)
    (tmp_path / "lock").write_text("")
    with extension.build_lock(str(tmp_path)):
        assert holds_lock(tmp_path)
        assert (tmp_path / "lock").exists() is not file_baton
        with extension.build_lock(tmp_path):  # nested in the same thread: no wait on itself
            assert holds_lock(tmp_path)
        assert holds_lock(tmp_path)
    assert not holds_lock(tmp_path)
    with extension.build_lock(tmp_path):  # left, the folder is no longer recorded as held: locked again
        assert holds_lock(tmp_path)


@posix_only
def test_build_lock_is_reentrant_only_within_its_thread(tmp_path):
    """Another thread of the same process waits for the lock (its reentrancy is per thread, not per process)."""
    import threading

    entered = threading.Event()

    def other_build():
        with extension.build_lock(tmp_path):
            entered.set()

    with extension.build_lock(tmp_path):
        thread = threading.Thread(target=other_build)
        thread.start()
        assert not entered.wait(0.5)
    thread.join(10)
    assert entered.is_set()


@posix_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_build_lock_in_a_forked_child_waits_for_the_parent(tmp_path):
    """A child forked while its parent holds the lock inherits the thread's record of it, but not the lock: it must
    wait for the parent, not enter as if reentrant."""
    entered = tmp_path / "child_entered"
    with extension.build_lock(tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork in a process with threads (Python 3.12)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with extension.build_lock(tmp_path):
                    entered.write_text("")
                code = 0
            finally:
                os._exit(code)
        time.sleep(0.5)
        assert not entered.exists()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and entered.exists()


@posix_only
def test_build_loads_under_the_lock(tmp_path, monkeypatch):
    """build() calls cpp_extension.load while holding the build lock of its folder, and releases it, also when the
    load fails."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(extension.torch.version, "cuda", extension.torch.version.cuda or "13.0")
    monkeypatch.setattr(extension, "prebuilt_library", lambda arch: None)
    monkeypatch.setattr(extension, "_cuda_home", lambda: "/usr/local/cuda")
    monkeypatch.setattr(extension, "cache_root", lambda: tmp_path)
    held = []

    def load(build_directory, **kwargs):
        held.append(holds_lock(extension.Path(build_directory)))
        raise RuntimeError("compile failed (test)")

    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.raises(extension.BuildError, match="compile failed"):
        extension.build("9.0")
    assert held == [True]
    assert not holds_lock(extension.build_directory("9.0"))
