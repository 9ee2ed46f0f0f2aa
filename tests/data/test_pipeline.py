"""End to end on generated corpora: sources, cleaning, split, tokenizer cache, collate, loader, stats CLI."""

import json
import os

import numpy as np
import pytest
import torch

from data import Batch, DataConfig, build_data
from data.sources import HubUnavailableError, load_hub
from tests.data.helpers import BAD_ROWS, cfg_for, make_rows, write_jsonl

# the Batch fields that are int32 in every batching mode, packed included (docs/ARCHITECTURE.md "Batch")
INT32_FIELDS = ("src", "tgt_in", "tgt_out", "src_lengths", "tgt_lengths", "cu_seqlens_src", "cu_seqlens_tgt")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corpus")
    files = write_jsonl(tmp / "train.jsonl", make_rows(400) + BAD_ROWS)
    logs = []
    bundle = build_data(cfg_for(tmp, files), log=logs.append)
    return tmp, files, bundle, logs


def test_bad_rows_counted_not_crashing(corpus):
    _, _, b, _ = corpus
    r = b.report
    assert r.rows == 405
    assert r.dropped["not_a_string"] == 2 and r.dropped["missing_language"] == 1 and r.dropped["empty"] == 1
    assert r.dropped["too_long"] == 1
    assert r.kept == sum(len(s) for s in b.splits.values()) == 400
    assert b.split_record["sizes"] == {"train": 360, "valid": 20, "test": 20}


def test_split_is_seeded_disjoint_and_recorded(corpus, tmp_path):
    tmp, files, b, _ = corpus
    rows = {k: set(v.rows.tolist()) for k, v in b.splits.items()}
    assert (
        not (rows["train"] & rows["valid"])
        and not (rows["train"] & rows["test"])
        and not (rows["valid"] & rows["test"])
    )
    again = build_data(cfg_for(tmp, files), log=lambda *_: None)
    assert again.split_record == b.split_record
    other = build_data(cfg_for(tmp_path, files, split_seed=1), log=lambda *_: None)
    assert set(other.splits["valid"].rows.tolist()) != rows["valid"]


def test_tokenizer_special_ids_and_round_trip(corpus):
    _, _, b, _ = corpus
    tok = b.tokenizer
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.sp.id_to_piece([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]
    texts = b.splits["valid"].src_text[:5] + [
        "gatto è sul tetto — ü ñ 🐈"
    ]  # unseen chars go through byte fallback
    ids = tok.encode(texts)
    assert all(x.dtype == np.int32 for x in ids) and not any((x == tok.unk_id).any() for x in ids)
    assert tok.decode(ids) == texts
    padded = [[tok.bos_id, *x.tolist(), tok.eos_id, 57, tok.pad_id] for x in ids]  # decode stops at EOS
    assert tok.decode(padded) == texts


def test_tokenizer_cache_reused_and_invalidated(corpus, tmp_path):
    tmp, files, b, _ = corpus
    logs = []
    again = build_data(cfg_for(tmp, files), log=logs.append)
    assert any("cache hit" in line for line in logs)
    assert again.tokenizer.key == b.tokenizer.key and again.tokenizer.model_file == b.tokenizer.model_file
    mtime = os.path.getmtime(b.tokenizer.model_file)
    assert os.path.getmtime(again.tokenizer.model_file) == mtime
    changed = build_data(cfg_for(tmp, files, vocab_size=350), log=logs.append)  # settings changed -> retrain
    assert changed.tokenizer.key != b.tokenizer.key
    more = write_jsonl(tmp_path / "more.jsonl", make_rows(401))  # data changed -> retrain
    assert build_data(cfg_for(tmp, more), log=logs.append).tokenizer.key != b.tokenizer.key


def test_tokenizer_learns_from_train_split_only(tmp_path):
    """A word frequent in held-out rows only must not become a vocabulary piece; in train rows it must.
    With split_grouping="source" the split depends on the sources only, so planting the word in targets
    leaves every row in its split."""
    n, kw = 300, dict(valid_size=0.2, test_size=0.2, vocab_size=450, max_len_ratio=10.0, split_grouping="source")
    probe = build_data(
        cfg_for(tmp_path, write_jsonl(tmp_path / "p.jsonl", make_rows(n)), **kw), log=lambda *_: None
    )
    held_out = probe.splits["valid"].rows.tolist() + probe.splits["test"].rows.tolist()

    def with_word(rows_idx, name):
        rows = make_rows(n)
        for i in rows_idx:
            rows[i]["translation"]["it"] = "qwzyxv " * 3 + rows[i]["translation"]["it"]
        return build_data(cfg_for(tmp_path, write_jsonl(tmp_path / name, rows), **kw), log=lambda *_: None)

    held = with_word(held_out, "held.jsonl")
    assert set(held.splits["valid"].rows.tolist() + held.splits["test"].rows.tolist()) == set(held_out)
    assert held.tokenizer.sp.piece_to_id("▁qwzyxv") == held.tokenizer.unk_id
    train = with_word(probe.splits["train"].rows.tolist()[: len(held_out)], "train.jsonl")
    assert train.tokenizer.sp.piece_to_id("▁qwzyxv") != train.tokenizer.unk_id


def _reference_rows(b, split, i):
    sp = b.splits[split]
    s = sp.src_ids[sp.src_offsets[i] : sp.src_offsets[i + 1]].tolist()
    t = sp.tgt_ids[sp.tgt_offsets[i] : sp.tgt_offsets[i + 1]].tolist()
    return s, t


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "sorted", "token_bucket"])
def test_loader_batches_match_reference_and_cover_epoch(corpus, mode):
    _, _, b, _ = corpus
    seen = []
    for batch in b.loader("train", epoch=1, batching=mode):
        assert isinstance(batch, Batch)
        for name in INT32_FIELDS:
            assert getattr(batch, name).dtype == torch.int32, name
        B, S = batch.src.shape
        T = batch.tgt_in.shape[1]
        assert batch.tgt_out.shape == (B, T)
        for r, i in enumerate(batch.index.tolist()):
            s, t = _reference_rows(b, "train", i)
            assert batch.src[r].tolist() == s + [3] + [0] * (S - len(s) - 1)  # EOS never dropped
            assert batch.tgt_in[r].tolist() == [2] + t + [0] * (T - len(t) - 1)
            assert batch.tgt_out[r].tolist() == t + [3] + [0] * (T - len(t) - 1)
        assert batch.max_src_len == int(batch.src_lengths.max()) and batch.max_tgt_len == int(
            batch.tgt_lengths.max()
        )
        assert batch.cu_seqlens_src.tolist() == [0, *np.cumsum(batch.src_lengths.tolist())]
        assert (
            batch.num_real_tokens
            == int(batch.src_lengths.sum() + batch.tgt_lengths.sum())
            == int((batch.src != 0).sum() + (batch.tgt_in != 0).sum())
        )
        assert batch.num_padded_tokens == B * (S + T)
        if mode == "token_bucket":
            assert batch.num_padded_tokens <= b.cfg.max_tokens
        if mode == "fixed":
            assert S == T == b.cfg.seq_len
        seen += batch.index.tolist()
    assert sorted(seen) == list(range(len(b.splits["train"])))


def _check_packed_batch(b, split, batch):
    """Every property of the packed contract (docs/ARCHITECTURE.md), rebuilding each pair from the streams."""
    L = b.pack_layout()
    N, Cs, Ct = L.slots, L.src_capacity, L.tgt_capacity
    assert batch.packed and batch.max_src_len == batch.max_tgt_len == L.max_len == b.cfg.max_len
    assert batch.src.shape == batch.src_pos.shape == (1, Cs)
    assert batch.tgt_in.shape == batch.tgt_out.shape == batch.tgt_pos.shape == (1, Ct)
    for name in ("src_lengths", "tgt_lengths"):
        assert getattr(batch, name).shape == (N,)
    for name in INT32_FIELDS:
        assert getattr(batch, name).dtype == torch.int32, name
    assert batch.src_pos.dtype == batch.tgt_pos.dtype == torch.int32
    src, tin, tout = batch.src[0].tolist(), batch.tgt_in[0].tolist(), batch.tgt_out[0].tolist()
    used_s = used_t = 0
    for side, cu, seg, pos, cap in (
        ("src", batch.cu_seqlens_src, batch.src_lengths, batch.src_pos[0], Cs),
        ("tgt", batch.cu_seqlens_tgt, batch.tgt_lengths, batch.tgt_pos[0], Ct),
    ):
        cu, seg = cu.tolist(), seg.tolist()
        assert len(cu) == N + 1 and cu[0] == 0 and cu[-1] == cap, side
        assert all(x <= y for x, y in zip(cu, cu[1:])) and seg == np.diff(cu).tolist(), side
        assert max(seg) <= L.max_len, side  # dummy tail segments too
        k = len(batch)
        real, rest = seg[:k], seg[k:]
        assert min(real) >= 1 and sum(real) == sum(seg) - sum(rest)
        nz = [i for i, x in enumerate(rest) if x]  # empty slots first, then the dummy tail segments
        assert nz == list(range(len(rest) - len(nz), len(rest))), (side, rest)
        used = sum(real)
        expect = [j for x in real for j in range(x)] + [0] * (cap - used)  # restarts at 0, 0 on padding
        assert pos.tolist() == expect, side
        used_s, used_t = (used, used_t) if side == "src" else (used_s, used)
    cs, ct = batch.cu_seqlens_src.tolist(), batch.cu_seqlens_tgt.tolist()
    for j, i in enumerate(batch.index.tolist()):  # segment j of src pairs with segment j of tgt: example i
        s, t = _reference_rows(b, split, i)
        assert src[cs[j] : cs[j + 1]] == s + [3]
        assert tin[ct[j] : ct[j + 1]] == [2] + t
        assert tout[ct[j] : ct[j + 1]] == t + [3]
    assert set(src[used_s:]) <= {0} and set(tin[used_t:]) <= {0} and set(tout[used_t:]) <= {0}
    assert batch.num_real_tokens == used_s + used_t == sum(x != 0 for x in src) + sum(x != 0 for x in tin)
    assert batch.num_padded_tokens == Cs + Ct


def test_packed_loader_streams_shapes_and_coverage(corpus):
    _, _, b, _ = corpus
    assert b.split_record["packing"] == b.pack_layout().as_dict()
    shapes = set()
    for epoch in (0, 1):
        seen = []
        for batch in b.loader("train", epoch=epoch, batching="packed"):
            _check_packed_batch(b, "train", batch)
            shapes.add(
                tuple(tuple(getattr(batch, f).shape) for f in ("src", "tgt_in", "src_lengths", "src_pos"))
            )
            seen += batch.index.tolist()
        assert sorted(seen) == list(range(len(b.splits["train"])))
    assert len(shapes) == 1  # one compiled graph for the whole run
    valid = list(b.loader("valid", batching="packed"))  # other splits use the train layout
    for batch in valid:
        _check_packed_batch(b, "valid", batch)
    assert sorted(i for x in valid for i in x.index.tolist()) == list(range(20))
    epochs = [[x.index.tolist() for x in b.loader("train", epoch=e, batching="packed")] for e in (3, 3, 4)]
    assert epochs[0] == epochs[1] != epochs[2]  # deterministic in (seed, epoch), reshuffled next epoch


def test_packed_loader_sharding_and_exact_resume(corpus):
    _, _, b, _ = corpus
    kw = dict(epoch=2, batching="packed")
    shards = [[x.index.tolist() for x in b.loader("train", rank=r, world_size=3, **kw)] for r in range(3)]
    assert (
        len({len(s) for s in shards})
        == 1
        == len({b.num_batches("train", rank=r, world_size=3, **kw) for r in range(3)})
    )
    assert len(shards[0]) == b.num_batches("train", rank=0, world_size=3, **kw)
    flat = sorted(i for s in shards for batch in s for i in batch)
    assert flat == list(range(len(b.splits["train"])))
    full = [x.index.tolist() for x in b.loader("train", **kw)]
    assert [x.index.tolist() for x in b.loader("train", start_batch=3, **kw)] == full[3:]


def test_packed_collate_tail_cut_into_dummy_segments(corpus):
    """One short pair in a large stream: the whole tail becomes <= max_len dummy segments after empty slots."""
    from data.batching import PackLayout
    from data.collate import PackedCollator

    _, _, b, _ = corpus
    sp = b.splits["train"]
    i = int(np.argmin(sp.src_lengths))
    layout = PackLayout(src_capacity=320, tgt_capacity=256, slots=12, max_len=64)  # 5 dummy, 7 real slots
    collate = PackedCollator(sp.src_ids, sp.src_offsets, sp.tgt_ids, sp.tgt_offsets, layout=layout)
    batch = collate([i])
    seg = batch.src_lengths.tolist()
    tail = 320 - int(sp.src_lengths[i])
    assert seg[0] == sp.src_lengths[i] and seg[1 : 12 - 5] == [0] * 6 and sum(seg[7:]) == tail
    assert seg[7:11] == [64] * 4 and 0 < seg[11] <= 64
    from kernels.packed_attention import segment_ids

    for b2 in (batch, collate(np.argsort(sp.src_lengths)[:5].tolist())):  # built by the workers = the kernels' rule
        for seg, cu, stream in ((b2.src_seg, b2.cu_seqlens_src, b2.src), (b2.tgt_seg, b2.cu_seqlens_tgt, b2.tgt_in)):
            assert seg.dtype == torch.int32 and torch.equal(seg, segment_ids(cu, stream.shape[1]))
    moved = batch.to("cpu")
    assert moved.packed and torch.equal(moved.src_pos, batch.src_pos) and torch.equal(moved.tgt_seg, batch.tgt_seg)
    plain = next(iter(b.loader("valid", batching="token_bucket")))
    assert plain.src_pos is None and plain.tgt_pos is None and plain.src_seg is None and not plain.packed
    assert plain.to("cpu").src_pos is None
    if torch.cuda.is_available():
        assert batch.pin_memory().src_pos.is_pinned() and plain.pin_memory().src_pos is None
    with pytest.raises(ValueError, match="real slots"):
        collate(list(range(8)))
    small = PackedCollator(
        sp.src_ids, sp.src_offsets, sp.tgt_ids, sp.tgt_offsets, layout=PackLayout(64, 64, 10, 64)
    )
    longest = np.argsort(-sp.src_lengths)[:9]
    assert sp.src_lengths[longest].sum() > 64
    with pytest.raises(ValueError, match="capacity"):
        small(longest.tolist())


def test_loader_sharding_and_exact_resume(corpus):
    _, _, b, _ = corpus
    shards = [[x.index.tolist() for x in b.loader("train", epoch=2, rank=r, world_size=3)] for r in range(3)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == b.num_batches(
        "train", epoch=2, rank=0, world_size=3
    )
    flat = sorted(i for s in shards for batch in s for i in batch)
    assert flat == list(range(len(b.splits["train"])))
    full = [x.index.tolist() for x in b.loader("train", epoch=2)]
    resumed = [x.index.tolist() for x in b.loader("train", epoch=2, start_batch=5)]
    assert resumed == full[5:]
    with pytest.raises(ValueError, match="start_batch"):
        b.loader("train", start_batch=len(full) + 1)


def test_loader_with_workers_and_batch_to(corpus):
    _, _, b, _ = corpus
    b.cfg.num_workers = 1
    try:
        batches = list(b.loader("valid"))
    finally:
        b.cfg.num_workers = 0
    assert sorted(i for x in batches for i in x.index.tolist()) == list(range(20))
    moved = batches[0].to("cpu", non_blocking=True)
    assert torch.equal(moved.src, batches[0].src) and moved.max_src_len == batches[0].max_src_len
    if torch.cuda.is_available():
        assert batches[0].pin_memory().src.is_pinned()


def test_fixed_mode_overlong_error_or_counted_truncation(corpus):
    _, _, b, _ = corpus
    b.cfg.seq_len = 8
    logs = []
    b.log = logs.append
    try:
        with pytest.raises(ValueError, match="seq_len=8"):
            b.loader("train", batching="fixed")
        b.cfg.overlong = "truncate"
        batch = next(iter(b.loader("train", batching="fixed")))
    finally:
        b.cfg.seq_len, b.cfg.overlong, b.log = 256, "error", print
    assert any("truncating" in line for line in logs)
    assert batch.src.shape[1] == 8
    assert ((batch.src == 3).sum(1) == 1).all() and ((batch.tgt_out == 3).sum(1) == 1).all()  # EOS kept


def test_tsv_parquet_and_env_sources_agree(tmp_path, monkeypatch):
    rows = make_rows(120, seed=3)
    tsv = tmp_path / "d.tsv"
    tsv.write_text("".join(f"{r['translation']['en']}\t{r['translation']['it']}\n" for r in rows))
    import datasets

    pq = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    kw = dict(valid_size=10, test_size=10)
    a = build_data(cfg_for(tmp_path, str(tsv), **kw), log=lambda *_: None)
    p = build_data(cfg_for(tmp_path, str(pq), **kw), log=lambda *_: None)
    monkeypatch.setenv("FASTMT_DATA_FILES", f"{tsv}")
    hub = DataConfig().dataset  # no files and not the toy source: $FASTMT_DATA_FILES replaces the Hub
    e = build_data(cfg_for(tmp_path, (), dataset=hub, **kw), log=lambda *_: None)
    assert a.split_record["fingerprint"] == p.split_record["fingerprint"] == e.split_record["fingerprint"]
    assert a.splits["train"].src_text == p.splits["train"].src_text


def test_config_validation_messages():
    with pytest.raises(ValueError, match="batching="):
        DataConfig(batching="buckets")
    with pytest.raises(ValueError, match="max_tokens"):
        DataConfig(max_tokens=100)
    with pytest.raises(ValueError, match="valid_size"):
        DataConfig(valid_size=1.5)
    assert DataConfig(data_files="my data/a, b.jsonl").data_files == ("my data/a, b.jsonl",)  # one path, whole
    assert DataConfig(data_files=["a b.jsonl", "c,d.tsv"]).data_files == ("a b.jsonl", "c,d.tsv")


def _no_network(monkeypatch):
    """Any connection attempt fails the test: a fast failure must not depend on a network timeout."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network connection attempted: {args} {kwargs}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_offline_hub_fails_fast_with_fix(monkeypatch):
    """Offline, the Hub path fails at once with the fix, before any connection attempt."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _no_network(monkeypatch)
    with pytest.raises(HubUnavailableError, match="--data-files"):
        load_hub("Helsinki-NLP/opus_books_not_cached_xyz", "en-it", "train")


def test_unreachable_hub_probe_fails_fast_with_fix(monkeypatch):
    """Online but unreachable: one probe connection bounded by ``probe_timeout``, then the fix (not the
    ~24 s of retries datasets makes on its own)."""
    import socket

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://10.255.255.1:9")  # non-routable
    probes = []

    def timing_out(address, timeout=None, *args, **kwargs):
        probes.append((address, timeout))
        raise TimeoutError("timed out")

    _no_network(monkeypatch)
    monkeypatch.setattr(socket, "create_connection", timing_out)
    with pytest.raises(HubUnavailableError, match="FASTMT_DATA_FILES"):
        load_hub("Helsinki-NLP/opus_books", "en-it", "train", probe_timeout=1.0)
    assert probes == [(("10.255.255.1", 9), 1.0)]


def test_stats_cli_json(corpus, capsys):
    """``fastmt stats`` (train/stats.py) takes training's flags; ``python -m data.stats`` points at it."""
    tmp, files, _, _ = corpus
    from data.stats import main as old_main
    from train.cli.stats import main

    assert old_main([]) == 2 and "fastmt stats" in capsys.readouterr().err
    flags = ["--preset", "tiny", "--data-files", files, "--data.cache_dir", str(tmp / "cache"), "--data.vocab_size",
             "400", "--data.max_len", "64", "--data.max_tokens", "512", "--data.valid_size", "20",
             "--data.test_size", "20", "--data.pad_multiple", "1"]
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"fixed", "dynamic", "sorted", "token_bucket", "packed"}
    packed = out["modes"]["packed"]
    assert packed["shapes"] == 1 and packed["padding_fraction"] < out["modes"]["dynamic"]["padding_fraction"]
    cap = out["packing"]["src_capacity"] + out["packing"]["tgt_capacity"]
    assert packed["computed_tokens"] == packed["batches"] * cap
    for m in out["modes"].values():
        assert 0 <= m["padding_fraction"] < 1 and m["batches"] >= 1 and m["shapes"] >= 1
    assert out["modes"]["token_bucket"]["padding_fraction"] < out["modes"]["fixed"]["padding_fraction"]
    assert out["report"]["dropped"]["too_long"] == 1
