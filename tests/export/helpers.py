"""What the export tests compare: fastmt's own decoding and teacher-forced log-probs of a model, on token ids."""

from __future__ import annotations

import torch

from models.decoding import beam_search, greedy_decode

PAD, BOS, EOS = 0, 2, 3


def padded(rows: list[list[int]], suffix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) int64 of ``row + suffix`` each, PAD-padded, and the int32 lengths."""
    rows = [r + suffix for r in rows]
    width = max(map(len, rows))
    x = torch.full((len(rows), width), PAD, dtype=torch.long)
    for b, r in enumerate(rows):
        x[b, : len(r)] = torch.tensor(r)
    return x, torch.tensor([len(r) for r in rows], dtype=torch.int32)


def fastmt_decode(model, src: list[list[int]], *, beam: int, alpha: float, a: float = 1.5, b: int = 10) -> list:
    """fastmt's answers (ids, no EOS) for sources given without their EOS: greedy when ``beam`` is 1."""
    x, n = padded(src, [EOS])
    if beam == 1:
        return greedy_decode(model, x, n, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_ratio=a, max_len_extra=b)
    return beam_search(model, x, n, bos_id=BOS, eos_id=EOS, pad_id=PAD, beam_size=beam, length_penalty=alpha,
                       max_len_ratio=a, max_len_extra=b)


@torch.no_grad()
def fastmt_logprobs(model, src: list[list[int]], tgt: list[list[int]]) -> list[list[float]]:
    """log p(target token | prefix, source) of each target token and the EOS after it (teacher forcing)."""
    model.eval()
    x, xn = padded(src, [EOS])
    y_in, yn = padded([[BOS] + t for t in tgt], [])
    y_out, _ = padded(tgt, [EOS])
    logp = torch.log_softmax(model(x, y_in, xn, yn).float(), -1)
    picked = logp.gather(-1, y_out[..., None])[..., 0]
    return [picked[b, : int(yn[b])].tolist() for b in range(len(tgt))]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
