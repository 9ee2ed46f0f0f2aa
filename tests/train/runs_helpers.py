"""Helpers of the run-folder tests: the toy data setting as command-line flags, file-tree snapshots."""

from __future__ import annotations

from pathlib import Path

# the toy data setting (data.config.toy) on the command line, so a CLI run reads the session's warm cache
TOY_FLAGS = ["--data.dataset", "toy", "--data.toy_rows", "1200", "--data.vocab_size", "400", "--data.max_len", "32",
             "--data.max_tokens", "512", "--data.pad_multiple", "8", "--data.valid_size", "60", "--data.test_size", "60"]


def train_argv(cache: str, out: Path, *extra: str, name: str = "t", plot: bool = False) -> list[str]:
    """``python -m train`` arguments: the tiny preset on the toy data, quiet, one thread, under ``out/runs``."""
    return ["--preset", "tiny", *TOY_FLAGS, "--data.cache_dir", cache, "--run.out_dir", str(Path(out) / "runs"),
            "--run.name", name, "--run.progress", "false", "--run.tensorboard", "false", "--run.plot", str(plot),
            "--run.cpu_threads", "1", "--eval.max_sentences", "16", "--eval.num_samples", "0", *extra]


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes): compare two snapshots to see that nothing changed."""
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
