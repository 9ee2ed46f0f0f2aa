"""fastmt -> CTranslate2: a ``TransformerSpec`` filled from the model, and ``CT2Translator``, which decodes an
exported directory with fastmt's decoding rules (what ``fastmt translate``/``evaluate`` and bench/inference.py use).

The spec holds fastmt's model exactly: pre-LN with a final LayerNorm per stack (eps 1e-5), sqrt(d_model)
embedding scale, bias-free linears (the spec's biases are omitted), fused QKV (self) and fused KV (cross) in
fastmt's row order ([q; k; v], heads contiguous), tied or untied embeddings, shared blocks unrolled (``optimize``
stores identical arrays once), and fastmt's own position table (interleaved sin/cos pairs from position 0, or the
learned tables). It has no mid-FFN LayerNorm: ``ffn_norm`` models are refused (train/export/supported.py: what each
target represents).

Decoding: CTranslate2's ``translate_batch`` defaults differ from fastmt's (beam 2, length penalty 1, max length
256, PAD and BOS allowed). Sources are cut as fastmt cuts them: ``max_input_length = max_positions`` keeps the first
``max_positions - 1`` pieces and the EOS (with 0, a longer source fails: the position table ends there). ``CT2Translator`` sets beam size, suppresses ``<pad>``/``<s>``, gives each sentence
fastmt's length limit ``min(floor(a * source tokens + b), max_positions - 1)`` (sentences are decoded in groups of
one limit: the option is per call) and, with a GNMT length penalty alpha > 0, which CTranslate2 lacks (it divides
by len^alpha), rescores its ``beam_size`` finished hypotheses with GNMT's ((5 + len) / 6)^alpha. With alpha = 0
(and greedy) the search is fastmt's (tests/export); with alpha > 0 the rescored n-best can differ from fastmt's
search in a few sentences.
"""

from __future__ import annotations

from pathlib import Path

from train.errors import UserError
from train.export.common import (
    CONFIG_FILE,
    DECODING_FILE,
    Source,
    applied_blocks,
    arr,
    by_length_limit,
    decoding_settings,
    layer_norm,
    pieces,
    position_table,
    public_config,
    read_export_records,
    shareable_spm,
    source_ids,
    write_json,
)
from train.export.supported import refuse_unsupported

QUANTIZATIONS = ("int8", "int8_float16", "float16")
# model.activation -> ctranslate2.specs.common_spec.Activation's member (keys: supported.SUPPORTED["ct2"]["activation"])
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_tanh": "GELUTanh"}
EPS = 1e-5  # fastmt's LayerNorm epsilon (kernels.layernorm, nn.LayerNorm's default)


def _ln(spec, norm) -> None:
    gain, bias = layer_norm(norm)
    spec.gamma, spec.beta = arr(gain), arr(bias)


def _ffn(spec, block) -> None:
    _ln(spec.layer_norm, block.norm_ffn)
    spec.linear_0.weight = arr(block.ffn.w1.weight)
    spec.linear_1.weight = arr(block.ffn.w2.weight)


def build_spec(src: Source):
    """The ``ctranslate2.specs.TransformerSpec`` of ``src`` (weights as float32 arrays, vocabulary registered)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, model = src.cfg, src.model
    act = getattr(common_spec.Activation, ACTIVATIONS[cfg.activation])
    spec = transformer_spec.TransformerSpec.from_config((cfg.enc_layers, cfg.dec_layers), cfg.n_heads,
                                                        pre_norm=True, activation=act)
    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = arr(model.src_embed.weight)
    enc.position_encodings.encodings = position_table(model, "src")
    for layer, block in zip(enc.layer, applied_blocks(model.encoder)):
        _ln(layer.self_attention.layer_norm, block.norm_attn)
        layer.self_attention.linear[0].weight = arr(block.attn.qkv.weight)
        layer.self_attention.linear[1].weight = arr(block.attn.out.weight)
        _ffn(layer.ffn, block)
    _ln(enc.layer_norm, model.encoder.final_norm)
    dec.embeddings.weight = arr(model.tgt_embed.weight)
    dec.position_encodings.encodings = position_table(model, "tgt")
    for layer, block in zip(dec.layer, applied_blocks(model.decoder)):
        _ln(layer.self_attention.layer_norm, block.norm_self)
        layer.self_attention.linear[0].weight = arr(block.self_attn.qkv.weight)
        layer.self_attention.linear[1].weight = arr(block.self_attn.out.weight)
        _ln(layer.attention.layer_norm, block.norm_cross)
        layer.attention.linear[0].weight = arr(block.cross_attn.q.weight)
        layer.attention.linear[1].weight = arr(block.cross_attn.kv.weight)
        layer.attention.linear[2].weight = arr(block.cross_attn.out.weight)
        _ffn(layer.ffn, block)
    _ln(dec.layer_norm, model.decoder.final_norm)
    dec.projection.weight = arr(model.output_weight())
    vocab = pieces(src.tok)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.add_source_eos = True  # fastmt's encoder input: subwords + </s>
    spec.config.layer_norm_epsilon = EPS
    return spec


def write(src: Source, out: Path, quantization: str | None) -> None:
    """Save the CTranslate2 model of ``src`` into the (empty, temp) folder ``out`` with its decoding settings."""
    refuse_unsupported("ct2", src.cfg, str(src.path))
    spec = build_spec(src)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(out))
    settings = decoding_settings(src)
    settings["quantization"] = quantization or "float32"
    positions = src.cfg.max_positions
    settings["ctranslate2"] = {
        "translate_batch": {"beam_size": settings["beam_size"], "length_penalty": 0.0,
                            "suppress_sequences": [["<pad>"], ["<s>"]], "max_input_length": positions,
                            "max_decoding_length": positions - 1, "min_decoding_length": 0, "return_end_token": True},
        "max_input_length": f"{positions}: a longer source is cut to its first {positions - 1} pieces + </s>, as "
                            f"fastmt cuts it (the position table ends there; 0 would fail past it)",
        "per_sentence": "max_decoding_length = the max length rule of the sentence (at most "
                        f"{positions - 1}); sentences of one limit together (fastmt.export.ct2.CT2Translator does this)",
        "gnmt": "with length_penalty > 0: num_hypotheses = beam_size, return_scores, pick the best "
                "score / ((5 + len) / 6) ** alpha (CTranslate2's own penalty divides by len ** alpha)"}
    write_json(out / DECODING_FILE, settings)
    write_json(out / CONFIG_FILE, public_config(src.config))
    (out / "spm.model").write_bytes(shareable_spm(src.tok.model_bytes()))


def is_ct2_dir(path: str | Path) -> bool:
    """A folder that ``fastmt export --to ct2`` made (model.bin and fastmt's decoding settings)."""
    p = Path(path)
    return p.is_dir() and (p / "model.bin").is_file() and (p / DECODING_FILE).is_file()


class CT2Translator:
    """An exported CTranslate2 directory decoded with fastmt's rules: ``translate(sentences, ...) -> texts``,
    ``score(sources, targets) -> per-token log-probs`` (targets scored with their EOS), ``settings``: the export's
    decoding settings (the checkpoint's eval settings), ``config``: the run config recorded at export."""

    def __init__(self, path: str | Path, device: str = "cpu", compute_type: str = "default", threads: int = 0):
        import ctranslate2

        from data.tokenizer import Tokenizer

        path = Path(path)
        if not is_ct2_dir(path):
            raise UserError(f"{path}: not a CTranslate2 export of fastmt (no model.bin or {DECODING_FILE}); make "
                            f"one with fastmt export --ckpt C --to ct2 {path}")
        self.path = path
        self.settings, self.config = read_export_records(path)  # through the one reader, bounded
        self.tok = Tokenizer(str(path / "spm.model"), inside=path)
        self.max_positions = int(self.settings["max_positions"])
        self.quantization = str(self.settings.get("quantization") or "float32")  # the type model.bin stores
        self.threads = threads  # intra_threads (0: CTranslate2's default)
        self.translator = ctranslate2.Translator(str(path), device=device, compute_type=compute_type,
                                                 intra_threads=threads)

    def _pieces(self, ids: list[list[int]]) -> list[list[str]]:
        return [[self.tok.sp.id_to_piece(i) for i in row] for row in ids]

    def translate_ids(self, src: list[list[int]], *, beam_size: int, length_penalty: float, max_len_a: float,
                      max_len_b: int, batch_size: int = 64) -> list[list[int]]:
        """Token ids (no EOS) of each source's translation (source ids without EOS, at most max_positions - 1)."""
        groups = by_length_limit(src, max_len_a, max_len_b, self.max_positions)
        out: list[list[int]] = [[] for _ in src]
        nbest = beam_size if beam_size > 1 and length_penalty > 0 else 1
        for limit, idx in groups.items():
            results = self.translator.translate_batch(
                self._pieces([src[k] for k in idx]), beam_size=beam_size, length_penalty=0.0, max_batch_size=batch_size,
                max_decoding_length=limit, min_decoding_length=0, max_input_length=self.max_positions,
                suppress_sequences=[["<pad>"], ["<s>"]],
                return_end_token=True, return_scores=nbest > 1, num_hypotheses=nbest)
            for k, r in zip(idx, results):
                best = r.hypotheses[0] if nbest == 1 else _gnmt_best(r.hypotheses, r.scores, length_penalty)
                out[k] = [self.tok.sp.piece_to_id(p) for p in best if p != "</s>"]
        return out

    def translate(self, sentences: list[str], *, beam_size: int, length_penalty: float, max_len_a: float,
                  max_len_b: int, batch_size: int = 64) -> list[str]:
        if not sentences:
            return []
        ids = self.translate_ids(source_ids(self.tok, sentences, self.max_positions), beam_size=beam_size,
                                 length_penalty=length_penalty, max_len_a=max_len_a, max_len_b=max_len_b,
                                 batch_size=batch_size)
        return self.tok.sp.decode(ids)

    def score(self, src: list[list[int]], tgt: list[list[int]]) -> list[list[float]]:
        """Log-probs of each target token and its EOS given the source (ids without EOS)."""
        results = self.translator.score_batch(self._pieces(src), self._pieces(tgt), max_input_length=self.max_positions)
        return [list(r.log_probs) for r in results]


def _gnmt_best(hyps: list[list[str]], scores: list[float], alpha: float) -> list[str]:
    """The hypothesis with the best GNMT-normalised score (``scores``: summed log-probs, EOS included)."""
    def norm(k: int) -> float:
        return scores[k] / ((5.0 + len(hyps[k])) / 6.0) ** alpha  # len counts the EOS when there is one

    return hyps[max(range(len(hyps)), key=lambda k: (norm(k), -k))]
