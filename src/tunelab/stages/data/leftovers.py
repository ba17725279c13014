"""Folders and files that operating systems, archivers and notebooks leave in a data folder:
never a label or an example, skipped with a note."""

from __future__ import annotations

LEFTOVER_FOLDERS = {
    "__macosx": "left by macOS's archiver",
    "@eadir": "a Synology NAS index",
    "$recycle.bin": "the Windows recycle bin",
    "system volume information": "a Windows system folder",
    "lost+found": "a file system's recovery folder",
    "__pycache__": "Python's bytecode cache",
    ".ipynb_checkpoints": "Jupyter's checkpoints",
}
LEFTOVER_FILES = {
    ".ds_store": "macOS folder settings",
    "thumbs.db": "a Windows thumbnail cache",
    "ehthumbs.db": "a Windows thumbnail cache",
    "desktop.ini": "Windows folder settings",
}


def leftover_folder(name: str) -> str | None:
    """Why a folder named `name` is an OS / archiver / notebook leftover, or None."""
    return LEFTOVER_FOLDERS.get(name.casefold())


def leftover_file(name: str) -> str | None:
    """Why a file named `name` is a leftover (AppleDouble `._x`, an editor backup `x~`, an
    Office lock file `~$x`), or None."""
    if name.casefold() in LEFTOVER_FILES:
        return LEFTOVER_FILES[name.casefold()]
    if name.startswith("._"):
        return "macOS resource fork (AppleDouble)"
    if name.startswith("~$"):
        return "an Office lock file"
    if name.endswith("~"):
        return "an editor's backup"
    return None
