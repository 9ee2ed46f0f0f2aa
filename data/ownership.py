"""Folders fastmt writes into: owned by this user, and nobody else may swap them.

A folder is trusted when it belongs to this user and no other user may write in it (others, or a group that
holds another user: `group_has_others`), and no folder above it (resolved) belongs to a user other than this
one and root or lets other users rename its entries (write permission without the sticky bit). The cache, run
folders, checkpoint folders, exports and compile caches all ask here (`ownership_problem`, `swap_problem`,
`own_folder`). Only ``stat`` calls: nothing here reads a file.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from .files import FileRefusedError, refuse_link


@functools.cache
def group_has_others(gid: int) -> bool:
    """Does group ``gid`` hold a user other than this one (a member, or a user whose primary group it is)? A user's
    own private group (what a umask of 002 writes for) does not; a group the system cannot name counts as shared."""
    import grp
    import pwd

    me = os.geteuid()
    try:
        members = grp.getgrgid(gid).gr_mem
        my_name = pwd.getpwuid(me).pw_name
    except KeyError:
        return True
    if any(m != my_name for m in members):
        return True
    return any(p.pw_gid == gid and p.pw_uid != me for p in pwd.getpwall())


def _writable_by_others(st: os.stat_result) -> bool:
    """Another user may create, rename or remove entries in the folder ``st`` describes: others may write, or a
    group holding another user may (`group_has_others`)."""
    return bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020) and group_has_others(st.st_gid)


def ownership_problem(path: str | os.PathLike) -> str | None:
    """Why another user could change what fastmt writes in the folder ``path`` (None: nobody can): it belongs to
    another user, or other users may write in it (others, or a group that holds another user); or a folder above
    it (resolved) belongs to a user other than this one and root, or lets other users rename its entries (write
    permission without the sticky bit)."""
    me = os.geteuid()
    try:
        st = os.stat(path)
    except OSError:
        return None  # missing: the caller makes it (and asks again), or reports the OS error
    if st.st_uid != me:
        return f"{path} belongs to user {st.st_uid}, not to you ({me})"
    if _writable_by_others(st):
        return f"other users may write in {path} (mode {stat.filemode(st.st_mode)}, group {st.st_gid})"
    return swap_problem(Path(path).resolve().parent, f"a folder above {path}")


def swap_problem(folder: str | os.PathLike, what: str = "the folder") -> str | None:
    """Why another user could rename or replace what lies in ``folder`` (resolved) or above it (None: nobody can):
    one of them belongs to a user other than this one and root, or lets other users write in it without the
    sticky bit."""
    me = os.geteuid()
    for up in (Path(folder).resolve(), *Path(folder).resolve().parents):
        try:
            m = os.stat(up)
        except OSError:
            continue
        if m.st_uid not in (me, 0):
            return f"{up}, {what}, belongs to user {m.st_uid}, who could replace it"
        if _writable_by_others(m) and not m.st_mode & stat.S_ISVTX:
            return f"{up}, {what}, lets other users replace it (mode {stat.filemode(m.st_mode)}, no sticky bit)"
    return None


def own_folder(path: str | os.PathLike, what: str, fix: str) -> Path:
    """``path`` made if missing (the umask's mode), refused (`FileRefusedError`) when it is a link, not a folder, or
    another user could change what fastmt writes there (`ownership_problem`): a folder fastmt writes into."""
    path = Path(path)
    refuse_link(path, what)
    path.mkdir(parents=True, exist_ok=True)
    refuse_link(path, what)  # (made by someone else between the two)
    if not path.is_dir():
        raise FileRefusedError(f"{what} {path} is not a folder; {fix}")
    problem = ownership_problem(path)
    if problem:
        raise FileRefusedError(f"{what} {path}: {problem}: fastmt writes only where nobody else can change what it "
                               f"wrote. Fix: {fix}")
    return path
