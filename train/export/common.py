"""What both export targets read from a fastmt checkpoint: the model (padded layout, eval mode, on the CPU), its
tokenizer's pieces in id order, each applied layer's block (shared blocks unrolled), the position tables, and the
model card; plus the one way an export directory is written (a temp folder beside OUT, renamed at the end).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.errors import UserError

DECODING_FILE = "fastmt_decoding.json"  # fastmt's decoding settings, beside an exported model
CONFIG_FILE = "fastmt_config.json"  # the training run's config (data languages, eval settings)
EXTRA = "pip install -e '.[export]'"  # what installs ctranslate2, transformers and safetensors


@dataclasses.dataclass
class Source:
    """A checkpoint loaded for export."""

    path: Path
    model: Any  # models.Transformer, padded layout, eval mode, CPU, fp32
    tok: Any  # data.tokenizer.Tokenizer
    ckpt: dict

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def config(self) -> dict:
        return self.ckpt.get("config") or {}




def pieces(tok) -> list[str]:
    """The tokenizer's pieces in id order (id k is line k of a vocabulary file)."""
    return [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]


def applied_blocks(stack) -> list:
    """The block module run at each applied layer of a ``models.layers.Stack`` (shared blocks repeat)."""
    return [stack.blocks[i] for i in stack.schedule]


def position_table(model, side: str) -> np.ndarray:
    """(max_positions, d_model) float32: what position p adds on ``side`` ("src"/"tgt"): the learned table, or
    fastmt's sinusoids (interleaved sin/cos pairs, position 0 first): the weight of the side's positions module
    (models.components.positions_for)."""
    return arr(getattr(model, f"{side}_pos").weight)


def layer_norm(norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(gain, bias) of a ``ResidualNorm``/``NormAct`` whose module the norm registry built as a LayerNorm
    (``models.components.LAYER_NORMS``); any other normalisation is refused, never written as a LayerNorm."""
    from models.components import LAYER_NORMS

    if not isinstance(norm.ln, LAYER_NORMS):
        raise UserError(f"export: the model's norm {type(norm.ln).__name__} is not a LayerNorm, which is all the "
                        f"export targets represent (train/export/supported.py)")
    return norm.ln.weight, norm.ln.bias


def arr(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def decoding_settings(src: Source) -> dict[str, Any]:
    """fastmt's decoding of this checkpoint (its eval settings), as an export records it."""
    from train.evaluation.decode import DECODING_DEFAULTS

    ev = src.config.get("eval") or {}
    get = lambda k: ev.get(k, DECODING_DEFAULTS[k])
    return {"beam_size": int(get("beam_size")), "length_penalty": float(get("length_penalty")),
            "length_penalty_kind": "gnmt: logprob / ((5 + len) / 6) ** alpha, len counts the EOS",
            "max_len_a": float(get("max_len_a")), "max_len_b": int(get("max_len_b")),
            "max_length_rule": "generated tokens (EOS included) <= min(floor(a * source tokens + b), max_positions "
                               "- 1), source tokens counting the source EOS, at least 1",
            "max_positions": src.cfg.max_positions, "source_suffix": "</s>",
            "decoder_start": "<s>", "suppressed_tokens": ["<pad>", "<s>"], "batch_size": int(get("batch_size"))}


def length_limit(n_source: int, a: float, b: float, max_positions: int) -> int:
    """fastmt's generated-token limit (EOS included) for a source of ``n_source`` tokens incl. its EOS
    (models.decoding.rule.length_limit: the same float arithmetic)."""
    import math

    return min(max(math.floor(n_source * a + b), 1), max_positions - 1)


def by_length_limit(src: list[list[int]], a: float, b: float, max_positions: int) -> dict[int, list[int]]:
    """The indices of ``src`` (source ids without EOS) grouped by fastmt's generated-token limit: each group decodes
    with one maximum length (what both exported translators do)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for k, ids in enumerate(src):
        groups[length_limit(len(ids) + 1, a, b, max_positions)].append(k)
    return groups


def source_ids(tok, sentences: list[str], max_positions: int) -> list[list[int]]:
    """Encoder inputs without the EOS: each sentence's subwords cut to ``max_positions - 1`` (as fastmt)."""
    return [list(map(int, ids[: max_positions - 1])) for ids in tok.encode(sentences)]


# -- the model card --------------------------------------------------------------------------------------------
def _test_record(src: Source) -> dict | None:
    """The run's last ``test`` record (metrics.jsonl of ``<run>/checkpoints/<ckpt>``'s run folder), if any."""
    from data.files import read_json_lines

    run = src.path.resolve().parent.parent
    try:  # the one reader: a regular file, no link inside the run folder, at most LOG_MAX bytes
        lines = read_json_lines(run / "metrics.jsonl", "metrics file", inside=run)
    except (OSError, ValueError):
        return None
    tests = [r for _, r in lines if isinstance(r, dict) and r.get("kind") == "test"]
    return _card_fields(tests[-1]) if tests else None


def _card_fields(rec: dict) -> dict:
    """What the model card shows of a test record, each value of the type it is printed as (numbers finite, texts
    cut): a copied-in record of another shape never breaks the card."""
    import math

    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    out = {k: rec[k] for k in ("test_bleu", "test_chrf") if num(rec.get(k))}
    out |= {k: rec[k][:300] for k in ("test_bleu_signature", "test_chrf_signature") if isinstance(rec.get(k), str)}
    if num(rec.get("test_sentences")):
        out["test_sentences"] = rec["test_sentences"]
    dec = rec.get("decoding") if isinstance(rec.get("decoding"), dict) else {}
    out["decoding"] = {k: dec[k] for k in ("beam_size", "length_penalty") if num(dec.get(k))}
    return out


LICENSE_DEFAULT = "unknown"  # the model card's license when --license is not given: the training data's decides


def public_path(value: str) -> str:
    """A path as a shared folder may show it: its last component (never the author's folders)."""
    return Path(value).name if (os.sep in value or (os.altsep and os.altsep in value)) else value


# the config fields that name paths on the training machine (a Hub dataset id is a name, a local folder a path)
PATH_FIELDS = {"data": ("data_files", "valid_files", "test_files", "cache_dir", "dataset"),
               "run": ("out_dir", "cache_dir")}


def public_config(config: dict) -> dict:
    """The run config as an export records it (``fastmt_config.json``): every path field reduced to its last
    component (``public_path``), so that the folder names none of the author's folders."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    for section, fields in PATH_FIELDS.items():
        part = out.get(section)
        if not isinstance(part, dict):
            continue
        for key in fields:
            v = part.get(key)
            if isinstance(v, str) and (key != "dataset" or os.path.isabs(v) or Path(v).exists()):
                part[key] = public_path(v)
            elif isinstance(v, (list, tuple)):
                part[key] = [public_path(x) if isinstance(x, str) else x for x in v]
    return out


def shareable_spm(model_bytes: bytes) -> bytes:
    """A SentencePiece model without the paths its trainer recorded (``trainer_spec.model_prefix`` and ``input``:
    folders of the training machine); pieces, scores and normalisation are untouched, so it encodes the same."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    proto.trainer_spec.ClearField("model_prefix")
    proto.trainer_spec.ClearField("input")
    return proto.SerializeToString()


def hub_dataset(data: dict) -> str | None:
    """The Hub dataset id a run read (``data.dataset`` when no local files are named and it is neither the generated
    toy corpus nor a local folder), else None."""
    from data.config import TOY_DATASET

    dataset = data.get("dataset")
    if data.get("data_files") or not isinstance(dataset, str) or dataset == TOY_DATASET:
        return None
    return None if os.path.isabs(dataset) or Path(dataset).exists() else dataset


def corpus_name(data: dict) -> str:
    """What a run's data was, named without the author's folders."""
    from data.config import TOY_DATASET

    files = data.get("data_files") or []
    if files:
        return f"local files {', '.join(public_path(f) for f in files)}"
    dataset = data.get("dataset")
    if dataset == TOY_DATASET:
        return "fastmt's generated toy corpus"
    return hub_dataset(data) or f"a local dataset folder {public_path(str(dataset))}"


def card_metadata(src: Source, target: str, test: dict | None, license: str) -> str:
    """The model card's YAML metadata (huggingface_hub's ``ModelCardData``): languages, license, library, tags,
    datasets (a Hub dataset only), metrics, pipeline tag and, with a test record, the test BLEU/chrF with their
    sacreBLEU signatures as ``model-index`` results. No ``base_model``: trained from scratch."""
    from huggingface_hub import EvalResult, ModelCardData

    data = src.config.get("data") or {}
    langs = [x for x in (data.get("src_lang"), data.get("tgt_lang")) if isinstance(x, str)]
    hub = hub_dataset(data)
    ct2 = target == "CTranslate2"
    tags = ["translation", "fastmt", "ctranslate2" if ct2 else "pegasus", *(["custom_code"] if src.cfg.ffn_norm and not ct2 else [])]
    results = []
    if test and test.get("test_bleu") is not None:
        pair = "-".join(langs)
        name = f"{hub or corpus_name(data)} ({data.get('dataset_config') or pair}), fastmt's held-out test split"
        for metric, key, label in (("bleu", "test_bleu", "BLEU"), ("chrf", "test_chrf", "chrF")):
            if test.get(key) is None:
                continue
            results.append(EvalResult(task_type="translation", task_name=f"Translation {pair}",
                                      dataset_type=hub or "local", dataset_name=name, dataset_split="test",
                                      dataset_config=data.get("dataset_config") if hub else None,
                                      metric_type=metric, metric_name=label, metric_value=round(float(test[key]), 2),
                                      metric_args={"signature": f"{'BLEU' if metric == 'bleu' else 'chrF2'}|"
                                                                f"{test.get(key + '_signature')}",
                                                   "sentences": test.get("test_sentences")}))
    run = (src.config.get("run") or {}).get("name") or "model"
    meta = ModelCardData(language=langs or None, license=license, library_name="ctranslate2" if ct2 else "transformers",
                         tags=tags, datasets=[hub] if hub else None, metrics=["bleu", "chrf"],
                         pipeline_tag="translation", model_name=f"fastmt-{'-'.join(langs)}-{public_path(run)}",
                         eval_results=results or None)
    return meta.to_yaml()


def model_card(src: Source, target: str, notes: list[str], argv: list[str], license: str = LICENSE_DEFAULT) -> str:
    """README.md: YAML metadata (``card_metadata``), then the model, its data and split, the run's test BLEU/chrF
    with signatures, the command that made it. Paths are shown by their last component only."""
    cfg, data = src.cfg, src.config.get("data") or {}
    corpus = corpus_name(data) + (f" ({data['dataset_config']})" if hub_dataset(data) and data.get("dataset_config")
                                  else "")
    test = _test_record(src)
    lines = ["---", card_metadata(src, target, test, license).rstrip("\n"),
             "# base_model: none (trained from scratch by fastmt)", "---", "",
             f"# fastmt translator ({data.get('src_lang', '?')} -> {data.get('tgt_lang', '?')}), {target} export", "",
             f"- model: {cfg.enc_layers}+{cfg.dec_layers} layers (sharing {cfg.sharing}), d_model {cfg.d_model}, "
             f"{cfg.n_heads} heads, d_ff {cfg.d_ff}, {cfg.activation}, positions {cfg.positions}, "
             f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings, ffn_norm {cfg.ffn_norm}, vocabulary "
             f"{cfg.vocab_size} (SentencePiece), at most {cfg.max_positions} tokens per side; trained from scratch",
             f"- data: {corpus}; split: {data.get('valid_size', '?')} valid / {data.get('test_size', '?')} test "
             f"pairs held out (seed {data.get('split_seed', data.get('seed', '?'))})"]
    if test and test.get("test_bleu") is not None:
        dec = test.get("decoding") or {}
        lines.append(f"- test: BLEU {test['test_bleu']:.2f}, chrF {test.get('test_chrf') or 0:.2f} on "
                     f"{test.get('test_sentences')} sentences (fastmt, beam {dec.get('beam_size')}, GNMT alpha "
                     f"{dec.get('length_penalty')}); BLEU|{test.get('test_bleu_signature')}; "
                     f"chrF2|{test.get('test_chrf_signature')}")
    else:
        lines.append("- test: no test record in the run folder (score it: fastmt evaluate --ckpt THIS_DIR --src ...)")
    run = (src.config.get("run") or {}).get("name")
    lines.append(f"- checkpoint: {src.path.name} of run {public_path(str(run)) if run else '?'} "
                 f"(step {(src.ckpt.get('position') or {}).get('step', '?')})")
    lines += [f"- {n}" for n in notes]
    lines += ["", "Made by (paths shown by their last component):", "",
              "    " + " ".join(shlex.quote(public_path(a)) for a in ["fastmt", "export", *argv]), ""]
    return "\n".join(lines)


# -- writing the directory -------------------------------------------------------------------------------------
def check_out(out: Path, force: bool, ckpt: str | Path) -> None:
    """Refuse, before any work, an OUT that is a file, that holds the checkpoint, or a non-empty folder without
    ``--force``; ``--force`` replaces only a real folder of this user's that an earlier export wrote (its records
    read as an export's, every entry a regular file). A link at OUT (dangling or not) is refused: the export would
    be written, or a folder replaced, at its target. OUT's parent must be a folder nobody else can swap OUT in."""
    from data.ownership import ownership_problem, swap_problem

    if out.is_symlink():
        raise UserError(f"OUT {out} is a symbolic link (to {os.readlink(out)}): fastmt export writes only a real "
                        f"folder, never through a link; give the folder's own path")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT {out} is a file; give a folder path")
    if Path(ckpt).exists() and out.resolve() in (Path(ckpt).resolve(), *Path(ckpt).resolve().parents):
        raise UserError(f"OUT {out} holds the checkpoint {ckpt}: give a folder outside it")
    if out.is_dir() and any(out.iterdir()):
        if not (out / DECODING_FILE).is_file():
            raise UserError(f"OUT {out} exists and holds files fastmt export did not write (no {DECODING_FILE}): "
                            f"give another folder, or empty it yourself")
        if not force:
            raise UserError(f"OUT {out} holds an earlier export: pass --force to replace it, or another folder")
        try:
            read_export_records(out)
        except UserError as e:
            raise UserError(f"OUT {out}: --force replaces only a folder that fastmt export wrote, and this one is not "
                            f"({e}); give another folder, or empty it yourself") from None
        problem = ownership_problem(out)
        if problem:
            raise UserError(f"OUT {out}: {problem}: --force replaces only a folder of yours that nobody else can "
                            f"change; give another folder")
    parent = out.resolve().parent
    problem = swap_problem(parent, "the folder OUT is written in") if parent.is_dir() else None
    if problem:
        raise UserError(f"OUT {out}: {problem}: another user could replace the export as it is written; give a "
                        f"folder of yours")
    if not parent.is_dir():
        raise UserError(f"OUT {out}: its parent folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"OUT {out}: {parent} is not writable")


def write_dir(out: Path, build: Callable[[Path], None]) -> None:
    """``build(tmp)`` in a temp folder beside ``out``, then ``out`` replaced by it: a reader never sees a half
    export, and a failed build leaves ``out`` (and whatever was in it) as it was. The swap is made durable as
    ``data.files.atomic_write`` makes a file's (the folder fsynced after the rename); the umask is its too."""
    from data.files import fsync_dir, umask

    out = out.resolve()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    old = None
    try:
        build(tmp)
        follow_umask(tmp, umask())
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        if old is not None and not out.exists():
            os.replace(old, out)
            old = None
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_export_records(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """An export folder's ``fastmt_decoding.json`` and ``fastmt_config.json`` through the one reader (regular files of
    at most `data.files.RECORD_MAX` bytes, no link inside the folder), after every entry of the folder was checked
    a regular file (the libraries that read model.bin and the vocabularies open them by name: a FIFO there would
    hang them); ``max_positions`` bounded as the model field is. A refusal is one line (``UserError``)."""
    from data.files import CHECKPOINT_MAX, read_json
    from train.bounds import bounded

    path = Path(path)
    try:
        check_plain_folder(path, "export folder", CHECKPOINT_MAX)
        settings = read_json(path / DECODING_FILE, "export record", inside=path)
        config = read_json(path / CONFIG_FILE, "export record", inside=path)
        if not isinstance(settings, dict) or not isinstance(config, dict):
            raise ValueError(f"{path}: {DECODING_FILE} and {CONFIG_FILE} must be JSON objects")
        bounded("model.max_positions", settings.get("max_positions"), str(path / DECODING_FILE), int)
    except (OSError, ValueError) as e:
        raise UserError(" ".join(str(e).split())) from None
    return settings, config


def check_plain_folder(path: Path, what: str, limit: int) -> None:
    """Every entry of ``path`` a regular file (not a link, FIFO, device or folder) of at most ``limit`` bytes, else
    `data.files.FileRefusedError` naming it (a folder fastmt export wrote holds nothing else)."""
    import stat

    from data.files import FileRefusedError

    for entry in os.scandir(path):
        st = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise FileRefusedError(f"{what} {path}: {entry.name} is not a regular file of at most {limit:,} bytes "
                                   f"(a link, FIFO, device or folder): a fastmt export holds only its own files")


def follow_umask(folder: Path, mask: int) -> None:
    """Give ``folder`` and everything in it the modes the umask gives new files and folders: a library that writes
    its file privately (safetensors' 0600 ``model.safetensors``) or copies a file's mode does not decide them."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def write_json(path: Path, obj: Any) -> None:
    """A record of an export, through the one atomic writer (``data.files.atomic_write``)."""
    from data.files import atomic_write

    atomic_write(path, json.dumps(obj, indent=2) + "\n", what="export record")
