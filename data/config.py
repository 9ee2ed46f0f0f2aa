"""`DataConfig`: every knob of the data pipeline, validated in one place.

Defaults were chosen by measurement on the stand-in corpus (bench/results/vocab-sweep.md):
``vocab_size``, ``max_tokens`` and ``pad_multiple``.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

BATCHING_MODES = ("fixed", "dynamic", "sorted", "token_bucket", "packed")
SPM_MODELS = ("bpe", "unigram")
OVERLONG_POLICIES = ("error", "truncate")
DATA_FILES_ENV = "FASTMT_DATA_FILES"
TOY_DATASET = "toy"  # dataset name of the generated toy corpus (data/toy.py)
REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_data_files(value: str | os.PathLike | list | tuple | None) -> tuple[str, ...]:
    """Normalise ``data_files`` given as a str (whitespace- or comma-separated) or a sequence."""
    if value is None:
        return ()
    if isinstance(value, str | os.PathLike):
        return tuple(p for p in re.split(r"[\s,]+", os.fspath(value)) if p)
    if isinstance(value, list | tuple):  # one path per element: never split (a path may hold spaces or commas)
        if not all(isinstance(v, str | os.PathLike) for v in value):
            raise TypeError(f"data_files must be a list of paths, got {value!r}")
        return tuple(os.fspath(v) for v in value if os.fspath(v))
    raise TypeError(f"data_files must be a str or a list of str, got {type(value).__name__}: {value!r}")


@dataclass
class DataConfig:
    # --- source (HF datasets) ---
    # Hub id, used when no local data_files are given; "toy": the generated en-it toy corpus (data/toy.py),
    # written once into cache_dir (it then wins over $FASTMT_DATA_FILES, which only replaces the Hub)
    dataset: str = "Helsinki-NLP/opus_books"
    dataset_config: str | None = "en-it"  # Hub config name
    hf_split: str = "train"  # Hub split to read (opus_books has only "train"; we split it ourselves)
    data_files: tuple[str, ...] = ()  # local jsonl/parquet/tsv files; env FASTMT_DATA_FILES if empty
    src_lang: str = "en"  # key of the source side in {"translation": {...}} (tsv: first column)
    tgt_lang: str = "it"  # key of the target side (tsv: second column)
    toy_rows: int = 1500  # dataset="toy": rows generated (row i is the same for any toy_rows)
    # --- cleaning (lengths in subword tokens, incl. EOS on src / BOS on tgt) ---
    max_len: int = 256  # drop pairs with either side longer than this
    max_len_ratio: float = 3.0  # drop pairs whose longer side is > ratio x the shorter side
    # --- split ---
    valid_size: int | float = (
        1000  # int >= 0: rows (0: no valid split); float in [0, 1): fraction of clean rows
    )
    test_size: int | float = 1000  # same convention as valid_size
    split_seed: int = 0  # seed of the train/valid/test permutation
    # --- SentencePiece (one joint vocabulary, learned from the train split only) ---
    vocab_size: int = 8000  # requested size; small corpora may yield fewer pieces
    spm_model: str = "bpe"  # "bpe" | "unigram"
    character_coverage: float = 0.9995  # rare characters beyond this go through byte fallback
    spm_threads: int = 0  # SentencePiece training/encoding threads; 0 = all cores
    # --- batching ---
    batching: str = "token_bucket"  # "fixed" | "dynamic" | "sorted" | "token_bucket" | "packed"
    # token_bucket: budget of padded src+tgt tokens per batch (~ the seed's real tokens/step);
    # packed: the stream capacity C_src + C_tgt (split by the train token totals, each rounded up to 64)
    max_tokens: int = 2048
    batch_size: int = 32  # fixed / dynamic / sorted: sentences per batch
    seq_len: int = 256  # fixed: every sequence padded to this length
    overlong: str = "error"  # fixed: sequences longer than seq_len -> "error" or "truncate" (counted)
    pad_multiple: int = 1  # dynamic/sorted/token_bucket: padded lengths rounded up to a multiple of this
    seed: int = 0  # batch shuffling; each epoch draws from (seed, epoch)
    # --- loader ---
    num_workers: int = 2  # DataLoader worker processes (0 = main process)
    pin_memory: bool = True  # pinned host memory (only when CUDA is available)
    prefetch_factor: int = 4  # batches prefetched per worker
    cache_dir: str = field(default_factory=lambda: str(REPO_ROOT / ".cache" / "fastmt"))  # tokenizer + arrays

    def __post_init__(self):
        self.data_files = parse_data_files(self.data_files)
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
        if not self.max_len_ratio >= 1.0:
            raise ValueError(f"max_len_ratio={self.max_len_ratio} must be >= 1")
        for name in ("valid_size", "test_size"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or v < 0
                or (isinstance(v, float) and v >= 1)
            ):
                raise ValueError(f"{name}={v!r}: give an int count >= 0 or a float fraction in [0, 1)")
        if self.num_workers < 0 or self.spm_threads < 0:
            raise ValueError(f"num_workers={self.num_workers}, spm_threads={self.spm_threads} must be >= 0")
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
        """``data_files``, else () for the toy corpus, else ``$FASTMT_DATA_FILES``, else () meaning the Hub."""
        if self.data_files or self.is_toy():
            return self.data_files
        return parse_data_files(os.environ.get(DATA_FILES_ENV))

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
