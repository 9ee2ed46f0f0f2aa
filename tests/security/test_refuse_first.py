"""Refuse before reading or writing, and ownership (issue 35): a link or a non-regular file is refused before anything
is read through it or written beside it, at every component fastmt did not create (``eval/``, ``checkpoints/``, an
export's OUT and its parent); ``--force`` replaces only a real folder of this user's that a fastmt export wrote; a
run folder, data cache or compile cache that another user owns or may change is refused for writing (the data cache
is then used read-only), at every folder above it that could be swapped; a relative ``$XDG_CACHE_HOME`` is
ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.files import FileRefusedError
from tests.security.conftest import LEGACY_CKPT, REPO, legacy_run, victim

NOBODY = 65534


def _root_only():
    if os.geteuid() != 0:
        pytest.skip("chown needs root")


# ----------------------------------------------------------------------------------------------
# evaluate: a planted eval/ link
# ----------------------------------------------------------------------------------------------
def test_evaluate_never_writes_through_a_planted_eval_link(tmp_path, capsys):
    from train.cli.evaluate import main

    run = legacy_run(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (run / "eval").symlink_to(target)
    src = tmp_path / "src.txt"
    src.write_text("the cat\n")
    assert main(["--ckpt", str(run / "checkpoints" / "step-00000003.pt"), "--src", str(src), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "eval" in err and "Traceback" not in err
    assert list(target.iterdir()) == []


def test_evaluate_refuses_an_eval_folder_another_user_owns(tmp_path, capsys):
    _root_only()
    from train.cli.evaluate import main

    run = legacy_run(tmp_path)
    (run / "eval").mkdir()
    os.chown(run / "eval", NOBODY, NOBODY)
    src = tmp_path / "src.txt"
    src.write_text("the cat\n")
    assert main(["--ckpt", str(run / "checkpoints" / "step-00000003.pt"), "--src", str(src), "--device", "cpu"]) == 2
    assert "belongs to user 65534" in capsys.readouterr().err and list((run / "eval").iterdir()) == []


# ----------------------------------------------------------------------------------------------
# export: OUT a link (dangling or not), --force on what an export did not write, OUT's parent
# ----------------------------------------------------------------------------------------------
def _export(out: Path, *extra: str) -> tuple[int, str]:
    from train.cli.export import main

    code = main(["--ckpt", str(LEGACY_CKPT), "--to", "hf", *extra, str(out)])
    return code


def test_export_into_a_dangling_link_writes_nothing_at_its_target(tmp_path, capsys):
    target = tmp_path / "not-yet"
    (tmp_path / "out").symlink_to(target)
    assert _export(tmp_path / "out") == 2
    assert "symbolic link" in capsys.readouterr().err and not target.exists()


def test_export_force_into_a_link_never_replaces_the_folder_it_points_to(tmp_path, capsys):
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "fastmt_decoding.json").write_text("{}")
    (folder / "chapter1.tex").write_text("a year of work")
    (tmp_path / "out").symlink_to(folder)
    assert _export(tmp_path / "out", "--force") == 2
    assert "symbolic link" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["chapter1.tex", "fastmt_decoding.json"]


@pytest.mark.parametrize("plant", ["not-an-export-record", "a-fifo", "a-link"])
def test_export_force_replaces_only_a_folder_an_export_wrote(tmp_path, capsys, plant):
    out = tmp_path / "out"
    out.mkdir()
    (out / "fastmt_decoding.json").write_text(json.dumps({"max_positions": 40}))
    (out / "fastmt_config.json").write_text("{}")
    if plant == "not-an-export-record":
        (out / "fastmt_decoding.json").write_text('"mine"')
    elif plant == "a-fifo":
        os.mkfifo(out / "model.bin")
    else:
        (out / "model.bin").symlink_to(victim(tmp_path))
    before = sorted(p.name for p in out.iterdir())
    assert _export(out, "--force") == 2
    err = capsys.readouterr().err
    assert "--force replaces only a folder that fastmt export wrote" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == before


def test_export_refuses_a_parent_another_user_could_swap_out_in(tmp_path, capsys):
    shared = tmp_path / "drop"
    shared.mkdir()
    shared.chmod(0o777)  # writable by everyone, no sticky bit
    assert _export(shared / "model") == 2
    assert "no sticky bit" in capsys.readouterr().err and not (shared / "model").exists()


# ----------------------------------------------------------------------------------------------
# run folders: checkpoints/ and the folder itself
# ----------------------------------------------------------------------------------------------
def test_a_planted_checkpoints_link_is_refused_and_its_target_untouched(tmp_path):
    from tests.security.test_checkpoints import _state
    from train.runs.folder import write_marker
    from train.runs.saving import CheckpointManager

    run = tmp_path / "run"
    run.mkdir()
    write_marker(run, "mine")
    target = tmp_path / "theirs"
    target.mkdir()
    (run / "checkpoints").symlink_to(target)
    with pytest.raises(FileRefusedError, match="symbolic link"):
        CheckpointManager(run / "checkpoints", keep_last=1, run_id="mine").save(_state(1, "mine"), 1)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("how", ["world-writable-of-another-user", "another-users", "parent-of-another-user"])
def test_a_run_folder_another_user_owns_or_may_change_is_refused(tmp_path, how):
    _root_only()
    from train.runs.folder import claim_run_folder

    out = tmp_path / "runs"
    (out / "x").mkdir(parents=True)
    if how == "world-writable-of-another-user":  # empty, made by another user, mode 0777: once adopted, they
        os.chown(out / "x", NOBODY, NOBODY)     # could plant checkpoints/ as a link
        (out / "x").chmod(0o777)
    elif how == "another-users":
        os.chown(out / "x", NOBODY, NOBODY)
    else:
        (out / "x").rmdir()
        os.chown(out, NOBODY, NOBODY)
    with pytest.raises(FileRefusedError, match="run folder") as e:
        claim_run_folder(out, "x", "mine")
    assert "\n" not in str(e.value) and "--run.out_dir" in str(e.value)
    assert not any((out / "x").iterdir()) if (out / "x").exists() else True


def test_a_group_writable_folder_counts_only_when_the_group_holds_another_user(tmp_path):
    _root_only()
    from data.ownership import group_has_others, ownership_problem

    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o775)
    assert not group_has_others(os.getegid()) or ownership_problem(mine) is not None
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)  # nobody's own group: another user in it
    shared.chmod(0o770)
    assert group_has_others(NOBODY) and "other users may write" in ownership_problem(shared)


# ----------------------------------------------------------------------------------------------
# compile caches
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["parent-of-another-user", "group-writable"])
def test_a_compile_cache_under_a_folder_another_user_controls_is_refused(tmp_path, how):
    _root_only()
    from train.compile import CacheDirError, check_private

    parent = tmp_path / "parent"
    parent.mkdir()
    cache = parent / "cache"
    if how == "parent-of-another-user":
        os.chown(parent, NOBODY, NOBODY)
        parent.chmod(0o755)
    else:
        os.chown(parent, 0, NOBODY)
        parent.chmod(0o770)  # a group that holds another user may rename the cache
    with pytest.raises(CacheDirError, match="--run.cache_dir"):
        check_private(cache)


def test_a_relative_xdg_cache_home_is_ignored(tmp_path):
    home, work = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), XDG_CACHE_HOME="relative/cache")
    probe = "from train.compile import default_cache_dir as d; print(d())"
    r = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == home / ".cache" / "fastmt" / "compile"


# ----------------------------------------------------------------------------------------------
# the data cache: another user's, or one others may write, is used read-only
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["another-users", "world-writable"])
def test_a_data_cache_another_user_controls_is_read_only(tmp_path, how):
    _root_only()
    from data import build_data
    from data.cache import writable
    from tests.security.test_cache import _cfg

    cfg = _cfg(tmp_path)
    n = len(build_data(cfg, log=lambda *a: None).splits["train"])
    cache = Path(cfg.cache_dir)
    if how == "another-users":
        for p in [cache, *cache.rglob("*")]:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    else:
        cache.chmod(0o777)
    assert not writable(cache)
    before = sorted(str(p) for p in cache.rglob("*"))
    logs = []
    assert len(build_data(_cfg(tmp_path), log=logs.append).splits["train"]) == n
    assert sorted(str(p) for p in cache.rglob("*")) == before  # no lock file, no index record: nothing written


def test_an_out_dir_another_user_could_swap_is_refused_before_anything_is_built(tmp_path):
    _root_only()
    from tests.security.conftest import capped, one_error_line

    shared = tmp_path / "group"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)  # nobody's own group: another user may rename what fastmt would write here
    shared.chmod(0o775)
    r = capped(["-m", "train", "--preset", "tiny", "--data.dataset", "toy", "--data.toy_rows", "300",
                "--data.vocab_size", "300", "--data.valid_size", "20", "--data.test_size", "20",
                "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(shared / "runs"),
                "--run.device", "cpu", "--epochs", "1", "--run.max_steps", "1"], timeout=300)
    one_error_line(r, "--run.out_dir", "no sticky bit")
    assert not (tmp_path / "cache").exists() and not (shared / "runs").exists()  # refused before any side effect
