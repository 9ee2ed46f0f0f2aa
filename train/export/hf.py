"""fastmt -> Hugging Face: a folder that ``AutoModelForSeq2SeqLM.from_pretrained`` and ``MarianTokenizer`` load.

Pegasus is the stock encoder-decoder closest to fastmt's model: pre-LN with a final LayerNorm per stack,
``scale_embedding`` (sqrt(d_model)), relu/gelu/gelu_tanh (``gelu_pytorch_tanh``), tied ``shared``/``lm_head`` or
(``tie_word_embeddings=false``) separate encoder, decoder and output matrices. Its biases are stored as zeros,
fastmt's position table (interleaved sinusoids from position 0, or the learned tables) as its position weights,
shared blocks unrolled, fused QKV/KV split into q/k/v. A ``model.ffn_norm`` model (off by default) gets
``modeling_fastmt.py`` in the folder (a Pegasus subclass with the mid-FFN LayerNorm) and its own ``model_type``,
``fastmt_pegasus``: it loads with ``trust_remote_code=True`` and is refused, naming that flag, without it (never
loaded as a stock Pegasus that would drop the LayerNorms). The tokenizer is the
stock ``MarianTokenizer`` on fastmt's SentencePiece model with an id-ordered vocabulary (source: pieces + ``</s>``,
as fastmt). ``generation_config.json``: decoder start ``<s>`` (2), EOS ``</s>`` (3), no forced EOS, PAD and BOS
suppressed, beam size. HF's length penalty divides by len^alpha (fastmt's GNMT: ((5 + len) / 6)^alpha), so the
config says alpha 0; ``HFTranslator`` rescores the n-best with GNMT, as ``CT2Translator`` does.
"""

from __future__ import annotations

import json
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from train.export.common import (
    CONFIG_FILE,
    DECODING_FILE,
    Source,
    applied_blocks,
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

# model.activation -> transformers' ACT2FN name (keys: supported.SUPPORTED["hf"]["activation"])
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
REMOTE = "modeling_fastmt"  # the remote-code module shipped for ffn_norm models
REMOTE_CLASS = "FastmtPegasusForConditionalGeneration"
REMOTE_CONFIG = "FastmtPegasusConfig"
REMOTE_TYPE = "fastmt_pegasus"  # the model_type of an ffn_norm folder (what stock transformers does not know)


def hf_config(src: Source) -> dict:
    cfg = src.cfg
    conf = {
        "architectures": [REMOTE_CLASS if cfg.ffn_norm else "PegasusForConditionalGeneration"],
        "model_type": REMOTE_TYPE if cfg.ffn_norm else "pegasus", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
        "encoder_layers": cfg.enc_layers, "decoder_layers": cfg.dec_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "activation_function": ACTIVATIONS[cfg.activation],
        "max_position_embeddings": cfg.max_positions, "scale_embedding": True, "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3,
        "decoder_start_token_id": 2, "forced_eos_token_id": None, "tie_word_embeddings": cfg.tie_embeddings,
        "fastmt_ffn_norm": cfg.ffn_norm, "fastmt_sharing": cfg.sharing, "fastmt_positions": cfg.positions,
    }
    if cfg.ffn_norm:
        # its own model type: loading it without trust_remote_code is an error naming the flag, never a stock
        # Pegasus that drops the mid-FFN LayerNorms
        conf["auto_map"] = {"AutoConfig": f"{REMOTE}.{REMOTE_CONFIG}",
                            "AutoModelForSeq2SeqLM": f"{REMOTE}.{REMOTE_CLASS}"}
    return conf


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().cpu().clone().contiguous()


def state_dict(src: Source) -> dict[str, torch.Tensor]:
    """The Pegasus tensors of ``src`` (each its own memory: safetensors stores no aliases)."""
    cfg, model, d = src.cfg, src.model, src.cfg.d_model
    sd: dict[str, torch.Tensor] = {}

    def ln(name, norm):
        gain, bias = layer_norm(norm)
        sd[f"{name}.weight"], sd[f"{name}.bias"] = _t(gain), _t(bias)

    def linear(name, weight):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = _t(weight), _zeros(weight.shape[0])

    def ffn(p, block):
        ln(f"{p}.final_layer_norm", block.norm_ffn)
        linear(f"{p}.fc1", block.ffn.w1.weight)
        linear(f"{p}.fc2", block.ffn.w2.weight)
        if cfg.ffn_norm:
            ln(f"{p}.activation_fn.ln", block.ffn.act)

    def self_attn(p, norm, attn):  # the fused QKV projection split into Pegasus' q/k/v_proj
        ln(f"{p}.self_attn_layer_norm", norm)
        for name, w in zip("qkv", attn.qkv.weight.split(d)):
            linear(f"{p}.self_attn.{name}_proj", w)
        linear(f"{p}.self_attn.out_proj", attn.out.weight)

    for i, block in enumerate(applied_blocks(model.encoder)):
        p = f"model.encoder.layers.{i}"
        self_attn(p, block.norm_attn, block.attn)
        ffn(p, block)
    for i, block in enumerate(applied_blocks(model.decoder)):
        p = f"model.decoder.layers.{i}"
        self_attn(p, block.norm_self, block.self_attn)
        ln(f"{p}.encoder_attn_layer_norm", block.norm_cross)
        linear(f"{p}.encoder_attn.q_proj", block.cross_attn.q.weight)
        for name, w in zip("kv", block.cross_attn.kv.weight.split(d)):
            linear(f"{p}.encoder_attn.{name}_proj", w)
        linear(f"{p}.encoder_attn.out_proj", block.cross_attn.out.weight)
        ffn(p, block)
    ln("model.encoder.layer_norm", model.encoder.final_norm)
    ln("model.decoder.layer_norm", model.decoder.final_norm)
    sd["model.encoder.embed_positions.weight"] = torch.from_numpy(position_table(model, "src"))
    sd["model.decoder.embed_positions.weight"] = torch.from_numpy(position_table(model, "tgt"))
    sd["model.shared.weight"] = _t(model.src_embed.weight)
    if not cfg.tie_embeddings:  # untied: nothing is tied in the HF model either; each matrix stored
        sd["model.encoder.embed_tokens.weight"] = _t(model.src_embed.weight)
        sd["model.decoder.embed_tokens.weight"] = _t(model.tgt_embed.weight)
        sd["lm_head.weight"] = _t(model.output_weight())
    sd["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    return sd


def write(src: Source, out: Path) -> None:
    """Save the Hugging Face folder of ``src`` into the (empty, temp) folder ``out``."""
    from safetensors.torch import save_file
    from transformers import MarianTokenizer

    refuse_unsupported("hf", src.cfg, str(src.path))
    settings = decoding_settings(src)
    write_json(out / "config.json", hf_config(src))
    save_file(state_dict(src), str(out / "model.safetensors"), metadata={"format": "pt"})
    if src.cfg.ffn_norm:
        shutil.copyfile(Path(__file__).with_name(f"{REMOTE}.py"), out / f"{REMOTE}.py")
    spm = out / "fastmt_spm.model"
    spm.write_bytes(shareable_spm(src.tok.model_bytes()))
    vocab = out / "fastmt_vocab.json"
    vocab.write_text(json.dumps({p: i for i, p in enumerate(pieces(src.tok))}, ensure_ascii=False))
    data = src.config.get("data") or {}
    with quiet_marian():
        tok = MarianTokenizer(str(spm), str(spm), str(vocab), source_lang=data.get("src_lang"),
                              target_lang=data.get("tgt_lang"), model_max_length=src.cfg.max_positions)
    tok.save_pretrained(str(out))
    spm.unlink()
    vocab.unlink()
    write_json(out / "generation_config.json", {
        "decoder_start_token_id": 2, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0,
        "forced_eos_token_id": None, "num_beams": settings["beam_size"], "length_penalty": 0.0,
        "early_stopping": False, "suppress_tokens": [0, 2], "max_new_tokens": src.cfg.max_positions - 1,
        "do_sample": False})
    write_json(out / DECODING_FILE, settings)
    write_json(out / CONFIG_FILE, public_config(src.config))


@contextmanager
def quiet_marian():
    """MarianTokenizer without its "pip install sacremoses" warning: fastmt's ids come from SentencePiece alone
    (sacremoses would add a punctuation normaliser fastmt does not have)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
        yield


class HFTranslator:
    """An exported HF folder decoded with ``generate`` under fastmt's rules (per-sentence length limit, PAD/BOS
    suppressed, GNMT by n-best rescoring): ``translate_ids``, ``translate`` and ``score``, as ``CT2Translator``."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        from transformers import AutoModelForSeq2SeqLM, MarianTokenizer

        self.path = Path(path)
        self.settings, _ = read_export_records(self.path)  # through the one reader, bounded
        self.max_positions = self.settings["max_positions"]
        self.device = torch.device(device)
        self.model = AutoModelForSeq2SeqLM.from_pretrained(str(self.path), trust_remote_code=True).to(self.device)
        self.model.eval()
        with quiet_marian():
            self.tokenizer = MarianTokenizer.from_pretrained(str(self.path))
        self.sp = self.tokenizer.spm_source

    def _batch(self, rows: list[list[int]], suffix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [r + suffix for r in rows]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r)
            mask[b, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def translate_ids(self, src: list[list[int]], *, beam_size: int, length_penalty: float, max_len_a: float,
                      max_len_b: int, batch_size: int = 64) -> list[list[int]]:
        groups = by_length_limit(src, max_len_a, max_len_b, self.max_positions)
        out: list[list[int]] = [[] for _ in src]
        nbest = beam_size if beam_size > 1 and length_penalty > 0 else 1
        for limit, idx in groups.items():
            for s in range(0, len(idx), batch_size):
                part = idx[s : s + batch_size]
                ids, mask = self._batch([src[k] for k in part], [3])
                gen = self.model.generate(input_ids=ids, attention_mask=mask, num_beams=beam_size,
                                          num_return_sequences=nbest, max_new_tokens=limit, min_length=0,
                                          length_penalty=0.0, early_stopping=False, do_sample=False,
                                          output_scores=nbest > 1, return_dict_in_generate=True)
                seqs = gen.sequences[:, 1:].tolist()  # drop the decoder start
                scores = gen.sequences_scores.tolist() if nbest > 1 else None
                for j, k in enumerate(part):
                    cands = [_trim(seqs[j * nbest + n]) for n in range(nbest)]
                    if nbest == 1:
                        out[k] = cands[0][0]
                        continue
                    norm = [scores[j * nbest + n] / ((5.0 + cands[n][1]) / 6.0) ** length_penalty
                            for n in range(nbest)]
                    out[k] = cands[max(range(nbest), key=lambda n: (norm[n], -n))][0]
        return out

    def translate(self, sentences: list[str], *, beam_size: int, length_penalty: float, max_len_a: float,
                  max_len_b: int, batch_size: int = 64) -> list[str]:
        if not sentences:
            return []
        ids = self.translate_ids(source_ids(_SpTok(self.sp), sentences, self.max_positions), beam_size=beam_size,
                                 length_penalty=length_penalty, max_len_a=max_len_a, max_len_b=max_len_b,
                                 batch_size=batch_size)
        return self.sp.decode(ids)

    @torch.inference_mode()
    def score(self, src: list[list[int]], tgt: list[list[int]]) -> list[list[float]]:
        ids, mask = self._batch(src, [3])
        dec, _ = self._batch([[2] + t for t in tgt], [])
        labels, _ = self._batch(tgt, [3])
        logits = self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits.float()
        picked = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
        return [picked[b, : len(t) + 1].tolist() for b, t in enumerate(tgt)]


def _trim(seq: list[int]) -> tuple[list[int], int]:
    """(ids before the first EOS, PAD dropped; GNMT length: those + the EOS if there is one)."""
    if 3 in seq:
        seq = seq[: seq.index(3)]
        return [t for t in seq if t != 0], len([t for t in seq if t != 0]) + 1
    seq = [t for t in seq if t != 0]
    return seq, len(seq)


class _SpTok:
    """``source_ids``'s view of a SentencePiece processor (``encode`` of a list)."""

    def __init__(self, sp):
        self.sp = sp

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)
