"""The shared start of bench's command lines: common flags, comma-separated choices, data files (the toy
corpus in smoke runs), a benchmark's run config at smoke scale, its first training batches, and the
label results give their data."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

# The toy scale of every smoke run (with the toy corpus): a 400-piece vocabulary, pairs of up to 32 tokens.
SMOKE_DATA = {"vocab_size": 400, "max_len": 32, "valid_size": 40, "test_size": 40}


def add_cli_args(p: argparse.ArgumentParser, smoke: str, *, plot: bool = True,
                 data: str = "local jsonl/parquet/tsv files instead of the Hub") -> None:
    """The flags every bench CLI that runs a model has: --smoke, --data-files, --out (and --no-plot)."""
    p.add_argument("--smoke", action="store_true", help=f"{smoke} (automatic without CUDA)")
    p.add_argument("--data-files", nargs="+", metavar="F", help=data)
    p.add_argument("--out", type=Path, help="output folder (default bench/results; a temp dir with --smoke)")
    if plot:
        p.add_argument("--no-plot", action="store_true", help="skip the PNG")


def choose(p: argparse.ArgumentParser, flag: str, spec: str, known: Iterable[str]) -> list[str]:
    """The comma-separated names of ``spec``, each one of ``known`` (else the parser's error lists them)."""
    known = list(known)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"{flag}: unknown {unknown or names}; choose from {','.join(known)}")
    return names


def cli_data_files(p: argparse.ArgumentParser, a: argparse.Namespace, *, toy: Callable[[], Path] | None = None,
                   toy_rows: int = 1500, announce: bool = True) -> list[str]:
    """The shared start of a bench CLI: ``--smoke`` is automatic without CUDA (said once unless not
    ``announce``: the CLI's report says it), every ``--data-files`` must exist, and a smoke run without
    files gets ``toy_rows`` of the toy corpus written to ``toy()``."""
    if not torch.cuda.is_available() and not a.smoke:
        if announce:
            print(f"{p.prog}: no CUDA device: running the --smoke configuration", flush=True)
        a.smoke = True
    files = list(a.data_files or ())
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        p.error(f"--data-files: no such file(s) {missing}; give existing jsonl/parquet/tsv files")
    if a.smoke and not files and toy is not None:
        from data.toy import write_toy_corpus

        files = [str(write_toy_corpus(toy(), n=toy_rows))]
    return files


def bench_config(cfg, name: str, work: Path, data_files: Sequence[str], *, smoke: bool, **run: Any):
    """``cfg`` as a benchmark runs it: under ``work``, without TensorBoard, progress bars, plots or a test
    at the end, one data process; a smoke run on the CPU, compiled with aot_eager, at ``SMOKE_DATA``'s
    scale with its data cache under ``work``. ``run``: more RunConfig changes."""
    smoke_run = {"device": "cpu", "compile_backend": "aot_eager"} if smoke else {}
    run = dataclasses.replace(cfg.run, name=name, out_dir=str(work / "runs"), tensorboard=False, progress=False,
                              plot=False, **{**smoke_run, **run})
    data = dataclasses.replace(cfg.data, data_files=tuple(data_files), num_workers=0,
                               **({**SMOKE_DATA, "cache_dir": str(work / "cache")} if smoke else {}))
    return dataclasses.replace(cfg, data=data, run=run, eval=dataclasses.replace(cfg.eval, test_at_end=False))


def train_batches(bundle, n: int) -> list:
    """The first ``n`` batches of epoch 0's training plan, collated up front (the loader is never timed)."""
    from itertools import islice

    batches = list(islice(iter(bundle.loader("train", epoch=0)), n))
    if len(batches) < n:
        raise ValueError(f"the training split gives {len(batches)} batches; need {n} (fewer steps or more data)")
    return batches


def corpus_label(files: Sequence[str] = (), source: str = "") -> str:
    """How results name their data: "OPUS Books en-it" from the Hub, "stand-in corpus (<file names>)" for
    local files (``source``: a data split record's, e.g. "files:a.jsonl"), else ``source`` itself."""
    if "opus_books" in source.lower() or "opus-books" in source.lower():
        return "OPUS Books en-it"
    if files or source.startswith("files:"):
        return f"stand-in corpus ({','.join(Path(f).name for f in files) or source.removeprefix('files:')})"
    return source or "unknown corpus"
