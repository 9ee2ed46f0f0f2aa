"""bench/peers.py: the Hugging Face baseline on fastmt's data, at toy scale on the CPU.

Needs ``transformers`` (the ``peers`` extra, also in ``dev``); skipped without it.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.train.runs_helpers import tree

pytest.importorskip("transformers")

from bench import peers as P  # noqa: E402
from data.toy import write_toy_corpus  # noqa: E402
from train.evaluation.scores import spread  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

TOY = ["--data.vocab_size", "400", "--data.valid_size", "40", "--data.test_size", "40", "--data.max_len", "32",
       "--eval.max_sentences", "20"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(config, bundle, corpus path, cache dir) of the tiny preset on a toy corpus."""
    from data import build_data
    from train.config import apply_overrides, get_config

    tmp = tmp_path_factory.mktemp("peers")
    corpus = write_toy_corpus(tmp / "toy.jsonl", n=600)
    cache = tmp / "cache"
    overrides = dict(zip(TOY[::2], TOY[1::2]))
    overrides = {k.removeprefix("--"): v for k, v in overrides.items()}
    cfg = apply_overrides(get_config("tiny"), {**overrides, "data.data_files": str(corpus),
                                               "data.cache_dir": str(cache)})
    return cfg, build_data(cfg.data, log=lambda *_: None), corpus, cache


def test_model_has_fastmts_size_and_tied_embeddings(toy):
    cfg, bundle, _, _ = toy
    tok, m = bundle.tokenizer, cfg.model
    model = P.marian_model(m, tok, torch.device("cpu"))
    c = model.config
    assert (c.d_model, c.encoder_layers, c.decoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim) == (
        m.d_model, m.enc_layers, m.dec_layers, m.n_heads, m.d_ff)
    assert c._attn_implementation == "sdpa" and c.activation_function == "relu"
    assert (c.pad_token_id, c.decoder_start_token_id, c.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    # one shared embedding matrix: source, target and output projection
    shared = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == shared.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    # trainable parameters, analytically: the tied V x d embedding once, post-LN layers (2 LayerNorms per
    # sub-layer pair in the encoder, 3 in the decoder), no learned positions
    d, f, V = m.d_model, m.d_ff, tok.vocab_size
    attn, ln, ffn = 4 * (d * d + d), 2 * d, d * f + f + f * d + d
    want = V * d + m.enc_layers * (attn + ffn + 2 * ln) + m.dec_layers * (2 * attn + ffn + 3 * ln)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == want


def test_length_limit_processor_forces_eos_per_row():
    limits = torch.tensor([1, 3, 5])
    proc = P._length_limit_processor(limits, eos_id=3)
    for t in range(1, 7):  # input_ids hold the decoder start token + t - 1 generated tokens
        out = proc(torch.zeros(3, t, dtype=torch.long), torch.zeros(3, 10))
        forced = (out[:, 3] == 0) & torch.isinf(out[:, [0, 1, 2, 4, 9]]).all(1)
        assert forced.tolist() == [t >= lim for lim in limits.tolist()], t
        assert (out[~forced] == 0).all()  # other rows untouched


def test_translate_stops_each_sentence_at_its_own_limit(toy):
    """An untrained model rarely says EOS: every sentence runs to floor(a * len(src) + b) tokens, its own
    limit, not the longest sentence's in the batch."""
    cfg, bundle, _, _ = toy
    tok = bundle.tokenizer
    torch.manual_seed(0)
    model = P.marian_model(cfg.model, tok, torch.device("cpu"))
    src, _ = P.encode_split(bundle.splits["valid"], tok.eos_id, cfg.model.max_positions)
    src = src[:12]
    seen: list[list[int]] = []

    class Spy:  # the tokenizer, recording what generate returned
        pad_id, bos_id, eos_id = tok.pad_id, tok.bos_id, tok.eos_id

        def decode(self, ids):
            seen.extend([int(t) for t in row] for row in ids)
            return tok.decode(ids)

    out = P.translate(model, Spy(), src, torch.device("cpu"), beam_size=2, batch_size=12, max_len_ratio=0.5,
                      max_len_extra=1)
    assert len(out) == 12 and all(isinstance(t, str) for t in out)
    limits = sorted(math.floor(0.5 * len(s) + 1) for s in src)
    assert len(set(limits)) > 1  # sentences of different lengths in one batch
    generated = []
    for row in seen:  # decoder start, then tokens up to EOS (pad after it)
        body = row[1:]
        generated.append(body.index(tok.eos_id) + 1 if tok.eos_id in body else len(body))
    assert len(generated) == 12 and all(g >= 1 for g in generated)
    # longest sources first: row i has the i-th largest limit
    assert all(g <= lim for g, lim in zip(generated, sorted(limits, reverse=True)))


def test_valid_loss_is_the_mean_per_target_token(toy):
    cfg, bundle, _, _ = toy
    tok = bundle.tokenizer
    torch.manual_seed(0)
    model = P.marian_model(cfg.model, tok, torch.device("cpu")).eval()
    src, tgt = P.encode_split(bundle.splits["valid"], tok.eos_id, cfg.model.max_positions)
    src, tgt = src[:9], tgt[:9]
    got = P.valid_loss(model, src, tgt, tok, torch.device("cpu"), batch_size=4)
    total, n = 0.0, 0
    with torch.no_grad():  # one sentence at a time: no padding at all
        for s, t in zip(src, tgt):
            s_, t_ = torch.from_numpy(s)[None], torch.from_numpy(t)[None]
            dec = torch.cat([torch.tensor([[tok.bos_id]]), t_[:, :-1]], 1)
            logits = model(input_ids=s_, decoder_input_ids=dec).logits
            total += float(F.cross_entropy(logits[0], t_[0], reduction="sum"))
            n += t_.shape[1]
    assert got == pytest.approx(total / n, rel=1e-5)


def test_cli_smoke_writes_fastmt_rows(toy, tmp_path):
    """Two short epochs and the test split through the command line; rows in fastmt's metrics format."""
    _, bundle, corpus, cache = toy
    argv = ["--preset", "tiny", "--data-files", str(corpus), "--epochs", "2", "--batch-size", "128",
            "--out-dir", str(tmp_path), "--name", "hf", "--device", "cpu", *TOY, "--data.cache_dir", str(cache)]
    assert P.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["start", "epoch", "epoch", "test", "done"]
    steps = math.ceil(len(bundle.splits["train"]) / 128)
    epochs = rows[1:3]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["step"] for r in epochs] == [steps, 2 * steps]
    for r in epochs:
        for key in ("wall_seconds", "bleu", "valid_loss", "epoch_seconds", "eval_seconds"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        assert 0 <= r["bleu"] <= 100 and r["eval_sentences"] == 20 and "partial_epoch" not in r
        assert r["wall_seconds"] >= r["epoch_seconds"] + r["eval_seconds"]
    assert rows[0]["wall_seconds"] < epochs[0]["wall_seconds"] < epochs[1]["wall_seconds"] < rows[3]["wall_seconds"]
    # the lr of the last step taken: the linear schedule's last step before 0, planned to the steps run
    assert epochs[1]["lr"] == pytest.approx(5e-4 * P.PlannedSchedule(2 * steps, 0.1).factor(2 * steps - 1))
    # fastmt's protocol: validation decodes eval.max_sentences spread over the split, the test split is scored whole, with
    # sacreBLEU's signatures and fastmt's decoding settings
    test, sig = rows[3], "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:"
    assert len(bundle.splits["test"]) > 20 and test["test_sentences"] == len(bundle.splits["test"])
    assert math.isfinite(test["test_bleu"]) and test["test_bleu_signature"].startswith(sig)
    assert test["test_chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")
    assert all(r["bleu_signature"].startswith(sig) for r in epochs) and test["test_truncated_sources"] == 0
    assert test["decoding"] == {"decode": "beam", "beam_size": 2, "length_penalty": 0.6, "max_len_a": 1.5,
                                "max_len_b": 10}
    best = max(epochs, key=lambda r: r["bleu"])  # the test scores the best-BLEU weights, as fastmt scores best.pt
    assert rows[3]["weights"] == "best valid BLEU" and rows[4]["best_bleu"] == best["bleu"]
    assert rows[4]["stop_reason"] == "done" and rows[4]["step"] == 2 * steps
    prov = json.loads((tmp_path / "hf" / "provenance.json").read_text())
    assert prov["config"]["peer"]["label_smoothing"] == 0.1 and prov["config"]["peer"]["lr"] == 5e-4
    assert prov["config"]["data"]["data_files"] == [str(corpus)]
    assert (tmp_path / "hf" / "curves.png").is_file()


def test_wall_budget_stops_at_a_step_boundary_and_evaluates(toy, tmp_path):
    cfg, bundle, _, _ = toy
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, test_at_end=False))
    recipe = P.PeerRecipe(epochs=3, batch_size=64, max_wall_seconds=100.0)
    ticks = iter(range(0, 10_000, 60))  # a clock that passes 100 s at its 3rd reading
    summary = P.train_peer(cfg, recipe, run_dir=tmp_path / "hf", device=torch.device("cpu"), bundle=bundle,
                           clock=lambda: float(next(ticks)), log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["start", "epoch", "done"]
    assert rows[1]["step"] == 2 and rows[1]["partial_epoch"] is True and math.isfinite(rows[1]["bleu"])
    assert summary["steps"] == 2 and summary["epochs_done"] == 1 and summary["stop_reason"] == "max_wall_seconds"
    assert rows[2]["stop_reason"] == "max_wall_seconds"
    # a second run of the same name takes the next free name, as fastmt's runs do: the first is not moved
    first = tree(tmp_path / "hf")
    second = P.train_peer(cfg, dataclasses.replace(recipe, max_steps=1), run_dir=tmp_path / "hf",
                          device=torch.device("cpu"), bundle=bundle, log=lambda *_: None)
    assert summary["run_dir"] == str(tmp_path / "hf") and second["run_dir"] == str(tmp_path / "hf-2")
    assert tree(tmp_path / "hf") == first and not list(tmp_path.glob("hf.prev-*"))
    with pytest.raises(ValueError, match="max_wall_seconds=0"):
        P.PeerRecipe(max_wall_seconds=0)


def test_scores_go_through_fastmts_protocol(toy, monkeypatch):
    """The baseline is scored on the sentences fastmt scores (eval.max_sentences spread over validation, the test
    split whole), its sources cut to the model's positions as fastmt cuts them, decoded with the run's beam size,
    length limit and length penalty, scored by sacreBLEU with the signatures."""
    import sacrebleu

    cfg, bundle, _, _ = toy
    tok = bundle.tokenizer
    calls = []

    def generate(model, tok_, sources, device, **kw):  # stands in for MarianMTModel.generate's translations
        calls.append(([s.tolist() for s in sources], kw))
        return [f"x{i % 3}" for i in range(len(sources))]

    monkeypatch.setattr(P, "translate", generate)
    ev = dataclasses.replace(cfg.eval, max_sentences=7, beam_size=3, length_penalty=0.8, max_len_a=1.2, max_len_b=4)
    for split, n in (("valid", 7), ("test", len(bundle.splits["test"]))):
        sp = bundle.splits[split]
        rows = spread(len(sp), n)
        src, refs = [sp.src_text[i] for i in rows], [sp.tgt_text[i] for i in rows]
        sc = P.scores(None, bundle, split, torch.device("cpu"), ev, 12)
        want = [[*tok.encode([t])[0][:11].tolist(), tok.eos_id] for t in src]
        sources, kw = calls[-1]
        assert sources == want and kw == {"beam_size": 3, "batch_size": ev.batch_size, "max_len_ratio": 1.2,
                                          "max_len_extra": 4, "length_penalty": 0.8}
        long = sum(len(tok.encode([t])[0]) + 1 > 12 for t in src)
        assert sc["sentences"] == n and sc["truncated_sources"] == long
        hyps = [f"x{i % 3}" for i in range(n)]
        assert sc["bleu"] == sacrebleu.corpus_bleu(hyps, [refs]).score
        assert sc["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert n > 7 and long > 0  # the test split is longer than the validation cap; some sources were cut


# -- the fair recipe (issue 44) ---------------------------------------------------------------------------------
def test_embeddings_are_scaled_by_sqrt_d_model(toy):
    """scale_embedding on (the H200 run's baseline left it off and never left unigrams): the encoder's token
    embeddings enter at sqrt(d_model) times the table's values."""
    cfg, bundle, _, _ = toy
    model = P.marian_model(cfg.model, bundle.tokenizer, torch.device("cpu"))
    assert P.PeerRecipe().scale_embedding is True and model.config.scale_embedding is True
    enc = model.model.encoder
    assert enc.embed_scale == pytest.approx(math.sqrt(cfg.model.d_model))
    off = P.marian_model(cfg.model, bundle.tokenizer, torch.device("cpu"), scale_embedding=False)
    assert off.model.encoder.embed_scale == 1.0


def test_schedule_is_planned_to_the_steps_or_the_wall_budget():
    """Warm-up over warmup_ratio of the plan, linear decay to 0 at its end; the plan ends at the first of the step
    count and the wall budget, so a run cut by its budget has annealed (the H200 run was cut at step 671 of 3,006
    with lr still at 86 % of its peak)."""
    s = P.PlannedSchedule(1000, 0.1)
    assert s.factor(50) == pytest.approx(0.5) and s.factor(100) == pytest.approx(1.0)
    assert s.factor(550) == pytest.approx(0.5) and s.factor(1000) == 0.0 and s.factor(0) > 0
    w = P.PlannedSchedule(10 ** 6, 0.1, budget_s=200.0)  # an epoch plan that never happens, a 200 s budget
    assert w.factor(10, seconds=10.0) == pytest.approx(0.5)  # 5 % of the budget: half-way through warm-up
    assert w.factor(10, seconds=110.0) == pytest.approx(0.5)  # 55 %: half-way down
    assert w.factor(10, seconds=200.0) == 0.0
    with pytest.raises(ValueError, match="budget_s"):
        P.PlannedSchedule(10, 0.1, budget_s=0.0)


def test_training_follows_the_planned_schedule_and_pads_to_a_multiple(toy, tmp_path):
    """The lr logged at the end of a max_steps run is the plan's last step's (not an 18-epoch plan's), and every
    batch is padded to the recipe's multiple."""
    cfg, bundle, _, _ = toy
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, test_at_end=False))
    recipe = P.PeerRecipe(batch_size=32, max_steps=6, lr=1e-3)
    P.train_peer(cfg, recipe, run_dir=tmp_path / "hf", device=torch.device("cpu"), bundle=bundle,
                 log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    epoch = [r for r in rows if r["kind"] == "epoch"][-1]
    plan = P.PlannedSchedule(6, recipe.warmup_ratio)
    assert epoch["step"] == 6 and epoch["lr"] == pytest.approx(1e-3 * plan.factor(5))
    src, tgt = P.encode_split(bundle.splits["train"], bundle.tokenizer.eos_id, cfg.model.max_positions)
    for b in P.train_loader(src, tgt, recipe, bundle.tokenizer.pad_id, 0):
        assert b["input_ids"].shape[1] % 8 == 0 and b["labels"].shape[1] % 8 == 0
        break
