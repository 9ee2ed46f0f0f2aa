"""Joint SentencePiece tokenizer (BPE or unigram, byte fallback, ids pad=0 unk=1 bos=2 eos=3).

Trained once on a seeded sample of the train split (``spm_sample_pairs`` pairs, both sides; `data.build`
picks it) and cached as ``<cache_dir>/spm-<key>/spm.model``, where ``key`` hashes the inputs, the split and
every training setting; a matching key re-uses the model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def spm_settings(cfg) -> dict:
    """Everything that changes the trained model (part of the cache key)."""
    import sentencepiece as spm

    return {
        "model_type": cfg.spm_model,
        "vocab_size": cfg.vocab_size,
        "character_coverage": cfg.character_coverage,
        "byte_fallback": True,
        "ids": [PAD_ID, UNK_ID, BOS_ID, EOS_ID],
        "sentencepiece": spm.__version__,
        "sample": {"pairs": cfg.spm_sample_pairs, "seed": cfg.split_seed},
        "format": 2,
    }


ENCODE_BATCH = 1 << 14  # texts per SentencePiece call in `Tokenizer.encode`


class Tokenizer:
    """Thin wrapper over a SentencePiece model with the fixed special ids."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(
        self,
        model_file: str | os.PathLike | None = None,
        key: str = "",
        num_threads: int = 0,
        *,
        model_proto: bytes | None = None,
        inside: str | os.PathLike | None = None,
    ):
        """Load ``model_file`` (read through `data.files.read_bytes`: a regular file of at most
        ``TOKENIZER_MAX`` bytes, no link followed below ``inside``, the folder that holds it), or the serialized
        model ``model_proto`` (e.g. embedded in a checkpoint: loaded in memory, no file written)."""
        import sentencepiece as spm

        from .files import TOKENIZER_MAX, read_bytes

        if (model_file is None) == (model_proto is None):
            raise TypeError("give exactly one of model_file and model_proto")
        self.model_file = None if model_file is None else str(model_file)
        self.model_proto = model_proto
        self.inside = None if inside is None else str(inside)
        self.key = key
        self.num_threads = num_threads or (os.cpu_count() or 1)
        if model_proto is None:
            model_proto = read_bytes(self.model_file, "tokenizer model", limit=TOKENIZER_MAX, inside=self.inside)
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        got = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if got != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(
                f"{self.model_file or 'the embedded model'}: special ids (pad, unk, bos, eos) = {got}, "
                f"expected (0, 1, 2, 3)"
            )

    def model_bytes(self) -> bytes:
        """The serialized SentencePiece model (what a checkpoint embeds; `model_proto` loads it back)."""
        return self.sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str], *, add_eos: bool = False) -> list[np.ndarray]:
        """Batch-encode to int32 arrays of subword ids (no specials unless ``add_eos``), `ENCODE_BATCH` texts at a
        time (SentencePiece's lists of python ints take ~9x the arrays' memory); out of memory is ``MemoryError``."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of str; wrap a single sentence as [text]")
        texts, tail, out = list(texts), [EOS_ID] if add_eos else [], []
        for lo in range(0, len(texts), ENCODE_BATCH):  # SentencePiece's python lists live one batch at a time
            try:
                ids = self.sp.encode(texts[lo:lo + ENCODE_BATCH], out_type=int, num_threads=self.num_threads)
            except TypeError as e:  # pybind11's word for a result it could not allocate
                if "Unable to convert function return value" not in str(e):
                    raise
                raise MemoryError(f"out of memory encoding {len(texts):,} texts") from None
            out += [np.asarray(x + tail, dtype=np.int32) for x in ids]
        return out

    def decode(self, ids: list) -> list[str]:
        """Decode each sequence up to its first EOS, dropping pad and BOS."""
        out = []
        for seq in ids:
            seq = [int(t) for t in (seq.tolist() if hasattr(seq, "tolist") else seq)]
            if EOS_ID in seq:
                seq = seq[: seq.index(EOS_ID)]
            out.append([t for t in seq if t not in (PAD_ID, BOS_ID)])
        return self.sp.decode(out)

    def __getstate__(self):  # picklable for DataLoader workers / checkpoints
        return {
            "model_file": self.model_file,
            "model_proto": self.model_proto,
            "key": self.key,
            "num_threads": self.num_threads,
            "inside": self.inside,
        }

    def __setstate__(self, state):
        self.__init__(
            state["model_file"], state["key"], state["num_threads"], model_proto=state.get("model_proto"),
            inside=state.get("inside"),
        )

    def __repr__(self) -> str:
        where = f"model_file={self.model_file!r}" if self.model_file else "embedded model"
        return f"Tokenizer(vocab_size={self.vocab_size}, key={self.key!r}, {where})"


_VOCAB_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_spm(texts: list[str], settings: dict, out_dir: Path, threads: int, cfg) -> None:
    """Train ``out_dir/spm.model`` on ``texts`` (already the sample; fed in order, no further sampling).
    A vocabulary below what the text needs is a `DataInputError` naming the size that works."""
    import sentencepiece as spm

    from .clean import DataInputError

    if not texts:
        raise DataInputError("cannot train a tokenizer on an empty train split")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(Path(out_dir) / "spm"),
            model_type=settings["model_type"],
            vocab_size=settings["vocab_size"],
            character_coverage=settings["character_coverage"],
            byte_fallback=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            hard_vocab_limit=False,  # a small corpus gets a smaller vocab instead of an error
            input_sentence_size=0,  # all of ``texts``: the sample is drawn before
            shuffle_input_sentence=False,
            num_threads=threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        m = _VOCAB_TOO_SMALL.search(str(e))
        if m is None:
            raise
        need = int(m.group(2))
        raise DataInputError(
            f"data.vocab_size={cfg.vocab_size} is below the {need} pieces SentencePiece needs for this text "
            f"(the characters covering data.character_coverage={cfg.character_coverage:g}, 256 byte pieces, "
            f"4 special ids); set --data.vocab_size {need} or more (or lower --data.character_coverage)"
        ) from None
