"""`DataConfig`: every knob of the data pipeline, validated in one place.

Defaults were chosen by measurement on the stand-in corpus (bench/results/vocab-sweep.md):
``vocab_size``, ``max_tokens`` and ``pad_multiple``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

from data.declare import (
    EPOCH,
    MAX_BATCH_TOKENS,
    MAX_BUILD_WORKERS,
    MAX_COUNT,
    MAX_LENGTH,
    MAX_THREADS,
    MAX_VOCAB,
    MAX_WORKERS,
    RESOURCE,
    SAFE,
    SEED,
    Bounds,
    declare,
    refused,
)

Batching = Literal["fixed", "dynamic", "sorted", "token_bucket", "packed"]
SpmModel = Literal["bpe", "unigram"]
Overlong = Literal["error", "truncate"]
SplitGrouping = Literal["source_target", "source"]
BATCHING_MODES, SPM_MODELS = get_args(Batching), get_args(SpmModel)
OVERLONG_POLICIES, SPLIT_GROUPINGS = get_args(Overlong), get_args(SplitGrouping)
# where the data comes from: a resume may name it again (the tokenizer key, which hashes the cleaned data, the
# split and the SentencePiece settings, is compared: train/runs/resume.py check_tokenizer)
SOURCE = SAFE
OWN_DATA = refused("the run's split and tokenizer were made with it: another value is another run's data")
DATA_FILES_ENV = "FASTMT_DATA_FILES"  # several paths separated by os.pathsep (':' on POSIX, ';' on Windows)
TOY_DATASET = "toy"  # dataset name of the generated toy corpus (data/toy.py)
REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_data_files(value: str | os.PathLike | list | tuple | None, name: str = "data_files") -> tuple[str, ...]:
    """Normalise a file list: one path (str / PathLike) or a sequence of paths. A path is never split: spaces
    and commas are part of it (give several files as several items; the environment variable
    `DATA_FILES_ENV` separates them with ``os.pathsep``, see `env_data_files`)."""
    if value is None:
        return ()
    if isinstance(value, str | os.PathLike):
        path = os.fspath(value)
        return (path,) if path else ()
    if isinstance(value, list | tuple):
        out = []
        for v in value:
            if not isinstance(v, str | os.PathLike):
                raise TypeError(f"{name}: each item must be a path (str), got {type(v).__name__}: {v!r}")
            if os.fspath(v):
                out.append(os.fspath(v))
        return tuple(out)
    raise TypeError(f"{name} must be a path or a list of paths, got {type(value).__name__}: {value!r}")


def env_data_files() -> tuple[str, ...]:
    """``$FASTMT_DATA_FILES``: paths separated by ``os.pathsep`` (':' on POSIX), never by spaces or commas."""
    return tuple(p for p in os.environ.get(DATA_FILES_ENV, "").split(os.pathsep) if p)


@dataclass
class DataConfig:
    # --- source (HF datasets) ---
    # Hub id, used when no local data_files are given; "toy": the generated en-it toy corpus (data/toy.py),
    # written once into cache_dir (it then wins over $FASTMT_DATA_FILES, which only replaces the Hub)
    dataset: str = declare("Helsinki-NLP/opus_books", SOURCE)
    dataset_config: str | None = declare("en-it", SOURCE)  # Hub config name
    # Hub split to read (opus_books has only "train"; we split it ourselves)
    hf_split: str = declare("train", SOURCE)
    # local jsonl/json/parquet/tsv files, each item one path (never split on spaces or commas); if empty,
    # $FASTMT_DATA_FILES (paths separated by os.pathsep, ':' on POSIX)
    data_files: tuple[str, ...] = declare((), SOURCE)
    src_lang: str = declare("en", SOURCE)  # key of the source side in {"translation": {...}} (tsv: first column)
    tgt_lang: str = declare("it", SOURCE)  # key of the target side (tsv: second column)
    # dataset="toy": rows generated (row i is the same for any toy_rows)
    toy_rows: int = declare(1500, SOURCE, Bounds(1, 10**8, why="rows generated in memory"))
    # --- cleaning of TRAIN pairs (lengths in subword tokens, incl. EOS on src / BOS on tgt); valid and test
    # are never filtered: an over-long pair keeps its texts, its token arrays are cut to max_len (counted) ---
    max_len: int = declare(256, EPOCH, Bounds(2, MAX_LENGTH))  # drop train pairs with either side longer than this
    # drop train pairs whose longer side is > ratio x the shorter side
    max_len_ratio: float = declare(3.0, EPOCH, Bounds(1, None, inf_ok="inf keeps every length ratio"))
    # --- split (leakage-free: whole groups of pairs sharing a normalised source go to one split) ---
    # int >= 0: rows (0: no valid split); float in [0, 1): fraction of clean rows
    valid_size: int | float = declare(1000, SOURCE, Bounds(0, MAX_COUNT))
    test_size: int | float = declare(1000, SOURCE, Bounds(0, MAX_COUNT))  # same convention as valid_size
    split_seed: int = declare(0, SOURCE, SEED)  # seed of the group hash that orders groups into test, valid, train
    # "source_target": a group is all pairs linked by a shared normalised source OR target (measured on the
    # stand-in corpus: ~2 % of valid/test targets otherwise occur in train); "source": shared source only
    split_grouping: SplitGrouping = declare("source_target", OWN_DATA, since=3)
    # your own validation rows (same formats), used whole and in order
    valid_files: tuple[str, ...] = declare((), OWN_DATA, since=3)
    # your own test rows, used whole and in order (never filtered)
    test_files: tuple[str, ...] = declare((), OWN_DATA, since=3)
    # --- SentencePiece (one joint vocabulary, learned from a seeded sample of the train split) ---
    # requested size; small corpora may yield fewer pieces
    vocab_size: int = declare(8000, SOURCE, Bounds(300, MAX_VOCAB))
    spm_model: SpmModel = declare("bpe", SOURCE)  # "bpe" | "unigram"
    # rare characters beyond this go through byte fallback
    character_coverage: float = declare(0.9995, SOURCE, Bounds(0, 1, lo_open=True))
    # train pairs (both sides) SentencePiece learns from; 0 = all
    spm_sample_pairs: int = declare(100_000, OWN_DATA, Bounds(0, MAX_COUNT), since=3)
    # SentencePiece training threads; 0 = all cores
    spm_threads: int = declare(0, SAFE, Bounds(0, MAX_THREADS, machine="cores", why=RESOURCE))
    # processes that read, clean and encode a cold build; 0 = all cores, 1 = in-process
    build_workers: int = declare(0, SAFE, Bounds(0, MAX_BUILD_WORKERS, why="processes forked for a build"), since=3)
    # --- batching ---
    batching: Batching = declare("token_bucket", EPOCH)  # "fixed" | "dynamic" | "sorted" | "token_bucket" | "packed"
    # token_bucket: budget of padded src+tgt tokens per batch (~ the seed's real tokens/step);
    # packed: the stream capacity C_src + C_tgt (split by the train token totals, each rounded up to 64)
    max_tokens: int = declare(2048, EPOCH, Bounds(1, MAX_BATCH_TOKENS, why="tokens allocated per batch"))
    batch_size: int = declare(32, EPOCH, Bounds(1, MAX_LENGTH))  # fixed / dynamic / sorted: sentences per batch
    seq_len: int = declare(256, EPOCH, Bounds(1, MAX_LENGTH))  # fixed: every sequence padded to this length
    # fixed: sequences longer than seq_len -> "error" or "truncate" (counted)
    overlong: Overlong = declare("error", EPOCH)
    # dynamic/sorted/token_bucket: padded lengths rounded up to a multiple of this
    pad_multiple: int = declare(1, EPOCH, Bounds(1, 4096))
    seed: int = declare(0, EPOCH, SEED)  # batch shuffling; each epoch draws from (seed, epoch)
    # --- loader ---
    # DataLoader worker processes (0 = main process)
    num_workers: int = declare(2, SAFE, Bounds(0, MAX_WORKERS, why="processes forked for loading"))
    pin_memory: bool = declare(True, SAFE)  # pinned host memory (only when CUDA is available)
    # batches prefetched per worker
    prefetch_factor: int = declare(4, SAFE, Bounds(1, 64, why="batches held in memory per worker"))
    # tokenizer + arrays
    cache_dir: str = declare(resume=SAFE, factory=lambda: str(REPO_ROOT / ".cache" / "fastmt"))

    def __post_init__(self):
        self.data_files = parse_data_files(self.data_files)
        self.valid_files = parse_data_files(self.valid_files, "valid_files")
        self.test_files = parse_data_files(self.test_files, "test_files")
        if self.split_grouping not in SPLIT_GROUPINGS:
            raise ValueError(f"split_grouping={self.split_grouping!r}; choose one of {SPLIT_GROUPINGS}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching={self.batching!r}; choose one of {BATCHING_MODES}")
        if self.spm_model not in SPM_MODELS:
            raise ValueError(f"spm_model={self.spm_model!r}; choose one of {SPM_MODELS}")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong={self.overlong!r}; choose one of {OVERLONG_POLICIES}")
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"src_lang and tgt_lang are both {self.src_lang!r}; give two languages")
        if self.is_toy() and (self.src_lang, self.tgt_lang) != ("en", "it"):
            raise ValueError(
                f"dataset='toy' is an en-it corpus, but src_lang={self.src_lang!r}, "
                f"tgt_lang={self.tgt_lang!r}; "
                "set src_lang='en', tgt_lang='it' or give data_files"
            )
        names = (
            "max_len",
            "batch_size",
            "seq_len",
            "pad_multiple",
            "max_tokens",
            "prefetch_factor",
            "toy_rows",
            "vocab_size",
        )
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.max_len < 2:
            raise ValueError(f"max_len={self.max_len} must be >= 2 (one token plus EOS/BOS)")
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be >= 300 (byte fallback alone takes 256+4 ids)"
            )
        if not self.max_len_ratio >= 1.0:  # NaN fails too; inf = no ratio limit
            raise ValueError(f"max_len_ratio={self.max_len_ratio} must be >= 1")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage={self.character_coverage} must be in (0, 1]")
        for name in ("valid_size", "test_size"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
                or (isinstance(v, float) and v >= 1)
            ):
                raise ValueError(f"{name}={v!r}: give an int count >= 0 or a float fraction in [0, 1)")
        for name in ("num_workers", "spm_threads", "spm_sample_pairs", "build_workers", "split_seed", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an int >= 0")
        # a single example at max_len must fit the token budget, or the budget could not be honoured
        longest = 2 * _round_up(self.max_len, self.pad_multiple)
        if self.max_tokens < longest:
            raise ValueError(
                f"max_tokens={self.max_tokens} < {longest} = 2 * round_up(max_len={self.max_len}, "
                f"pad_multiple={self.pad_multiple}): one maximal pair would not fit; raise max_tokens or lower max_len"
            )

    def is_toy(self) -> bool:
        """The generated toy corpus is the source: ``dataset="toy"`` and no ``data_files``."""
        return self.dataset == TOY_DATASET and not self.data_files

    def resolved_data_files(self) -> tuple[str, ...]:
        """``data_files``, else () for the toy corpus, else ``$FASTMT_DATA_FILES`` (``os.pathsep``-separated),
        else () meaning the Hub."""
        if self.data_files or self.is_toy():
            return self.data_files
        return env_data_files()

    def files_from_env(self) -> bool:
        """The training files come from ``$FASTMT_DATA_FILES`` (for error messages naming it)."""
        return not self.data_files and not self.is_toy() and bool(env_data_files())

    def to_dict(self) -> dict:
        return asdict(self)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def toy(**changes) -> DataConfig:
    """The one small data setting of tests, CI and smoke runs: the generated toy corpus (or ``data_files=``),
    a 400-piece vocabulary, pairs up to 32 tokens, 512-token batches, 60 valid / 60 test pairs, no workers."""
    base = dict(dataset=TOY_DATASET, toy_rows=1200, vocab_size=400, max_len=32, max_tokens=512, pad_multiple=8,
                valid_size=60, test_size=60, num_workers=0)
    return DataConfig(**{**base, **changes})
