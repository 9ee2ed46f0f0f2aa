"""The whole training step as one pure function of static buffers: captured as one CUDA graph, replayed.

``StepGraph(batch)`` runs one optimizer step (forward, backward, gradient clipping, the finiteness guard and
the AdamW / Lion update) as a function of tensors only:

- every batch lands in static input buffers (one ``_foreach_copy_`` of the packed batch's fields, segment ids
  included, and of a small float32 "meta" row: the step's target-token count and each group's learning rate;
  on CUDA the host-to-device copy runs on a side stream into a staging set while the previous step still runs,
  then one device-local copy: ``prefetch``, ``_copy_ahead``). The schedule's
  next lr therefore reaches the update as a device tensor: no Python float that changes enters the step;
  ``grad_clip``, betas, eps and weight decay are constants of the run;
- the update is written in tensor ops (``adamw_update_``; Lion: ``kernels.lion.lion_step`` with a tensor lr)
  on the optimizer's own state (``exp_avg``, ``exp_avg_sq`` and a float32 device ``step`` per flat group:
  the layout torch's fused AdamW keeps, so checkpoints move between the graph and the eager step), the skip
  of a non-finite step applied with ``torch.where`` / lerp weights of 0 (no host read);
- on CUDA (``capture=True``) the first ``warmup`` steps of each batch shape run eagerly on a side stream
  (real steps, as torch's whole-network capture recipe), the next one is captured with ``torch.cuda.graph``
  and every later step of that shape is one replay. On the CPU the same static-buffer path runs eagerly,
  the update compiled with ``fullgraph=True`` when the run compiles (tests/train/test_step_audit.py checks it
  is pure: no ``.item()``, no host read).

``plan_step_graph`` decides whether it applies and says why not in one line (the Trainer records it):
DDP (the all-reduce hooks), fp16 (GradScaler's dynamic scale is not graph-safe here: the eager step keeps it),
batches that are not packed (token buckets change shape every batch), Adam (coupled
L2: the eager fused kernel), activation checkpointing. Those runs take the eager step (train/step.py).

Gradient accumulation (``optim.accum_steps`` k > 1) splits the step in two functions of static buffers: the
forward-backward of one micro-batch, which adds its gradients (each micro-batch's loss divided by the whole step's
target tokens, as the eager step) into the flat gradient buffers and its loss into a static sum, and the update,
which clips, guards and updates from them, then zeroes both for the next step. On CUDA each is its own graph (one
forward-backward graph per micro-batch shape, replayed k times, and one update graph): k + 1 replays a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.lion import lion_step_reference

# the packed batch's tensor fields, in the order the static buffers hold them
FIELDS = ("src", "tgt_in", "tgt_out", "src_lengths", "tgt_lengths", "cu_seqlens_src", "cu_seqlens_tgt",
          "src_pos", "tgt_pos", "src_seg", "tgt_seg")
OPTIMIZERS = ("adamw", "lion")  # optim.name values the graph-safe update implements


@dataclass(frozen=True)
class StepGraphPlan:
    """Whether a run's step is the static-buffer step, whether it is captured as a CUDA graph, and why not."""

    on: bool  # the static-buffer step (StepGraph) runs the training step
    capture: bool  # ... captured once per batch shape as a CUDA graph and replayed (CUDA only)
    reason: str  # one line: what was chosen and why


def plan_step_graph(cfg, device_type: str, *, distributed: bool) -> StepGraphPlan:
    """``run.step_graph`` (None: on for CUDA where it applies, off on the CPU; True on the CPU: the same static-
    buffer path run eagerly) against the run's settings. A run it cannot apply to falls back to the eager step,
    with the reason."""
    want = cfg.run.step_graph if cfg.run.step_graph is not None else device_type == "cuda"
    if not want:
        return StepGraphPlan(False, False, "step graph off (run.step_graph=false, or the CPU's default)")
    why = []
    if distributed:
        why.append("DDP (its all-reduce hooks run outside a captured step)")
    if cfg.run.precision == "fp16":
        why.append("fp16 (the GradScaler's dynamic scale stays on the eager step)")
    if cfg.data.batching != "packed":
        why.append(f"data.batching={cfg.data.batching!r} (batch shapes vary; the graph needs packed batches)")
    if cfg.optim.name not in OPTIMIZERS:
        why.append(f"optim.name={cfg.optim.name!r} (graph-safe updates: {', '.join(OPTIMIZERS)})")
    if cfg.model.checkpointing:
        why.append("model.checkpointing (recomputed activations cannot run under CUDA graphs)")
    if why:
        return StepGraphPlan(False, False, "step graph not used: " + "; ".join(why) + "; the eager step runs")
    capture = device_type == "cuda"
    k = cfg.optim.accum_steps
    graphs = ("one CUDA graph per step" if k == 1 else
              f"{k} forward-backward replays and one update replay per step (optim.accum_steps={k})")
    return StepGraphPlan(True, capture, f"step graph: {graphs} (captured per batch shape)" if capture
                         else "step graph: the static-buffer step, run eagerly (CPU: no CUDA graph)")


# ----------------------------------------------------------------------------------------------
# Graph-safe updates: tensors in, tensors updated in place, nothing read on the host
# ----------------------------------------------------------------------------------------------
def adamw_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: torch.Tensor, betas, eps: float,
                  weight_decay: float, keep: torch.Tensor) -> None:
    """torch's AdamW (decoupled decay, bias-corrected moments) on one flat group, ``lr`` a 0-d device tensor,
    ``keep`` 1.0 (apply) or 0.0 (a non-finite step: param, moments and step unchanged)."""
    b1, b2 = betas
    step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    g = torch.where(keep > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))  # no inf * 0 = NaN
    step.add_(keep)
    m.lerp_(g, (1 - b1) * keep)
    v.lerp_(g * g, (1 - b2) * keep)
    t = step.clamp(min=1.0)  # a skipped first step leaves step 0: its (unused) bias corrections stay finite
    bc1 = 1 - b1 ** t
    bc2 = 1 - b2 ** t
    denom = (v.sqrt() / bc2.sqrt()).add_(eps)
    param.mul_(1 - lr * weight_decay * keep)
    param.sub_((lr * keep / bc1) * (m / denom))


def init_state(optimizer: torch.optim.Optimizer, name: str) -> None:
    """The optimizer's state for every flat group, made now (outside any graph) when the first step has not yet."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if name == "adamw" and not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            elif name == "adamw":
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
            elif name == "lion" and not st:
                st["exp_avg"] = torch.zeros_like(p)


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------
class NormalisedLoss(nn.Module):
    """``step_module(tgt_out, **inputs) / n_tgt``: the loss per real target token, ``n_tgt`` a 0-d device tensor,
    so a whole-model compile holds the division too (one forward region)."""

    def __init__(self, step_module: nn.Module):
        super().__init__()
        self.step_module = step_module

    def forward(self, tgt_out: torch.Tensor, n_tgt: torch.Tensor, **inputs) -> torch.Tensor:
        return self.step_module(tgt_out, **inputs) / n_tgt


class StepGraph:
    """One training step of a packed batch as one pure function of static buffers (module docstring)."""

    def __init__(self, loss_fn: nn.Module, optimizer: torch.optim.Optimizer, flat, counters, *, name: str,
                 device: torch.device, autocast, grad_clip: float | None, guard: bool, capture: bool,
                 compile_update: dict | None = None, warmup: int = 3, prefetch: bool | None = None):
        self.loss_fn, self.optimizer, self.flat, self.counters = loss_fn, optimizer, flat, counters
        self.name, self.device, self.autocast = name, device, autocast
        self.grad_clip, self.guard, self.capture, self.warmup = grad_clip, guard, capture, warmup
        init_state(optimizer, name)
        # the update's constants per group (a compiled update guarded on the groups' dicts would recompile as lr moves)
        self._params = [p for params in flat.params for p in params]  # the model's parameters, flat order
        self._views = [v for views in flat._grad_views for v in views]  # their views into the flat gradients
        self._groups = [(tuple(g["params"]), tuple(optimizer.state[p] for p in g["params"]), tuple(g["betas"]),
                         g.get("eps"), g["weight_decay"]) for g in optimizer.param_groups]
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._seen: dict[tuple, int] = {}
        self.update = torch.compile(self._update, fullgraph=True, **compile_update) if compile_update else self._update
        self._compile_update = compile_update
        # the batch's host-to-device copy on a side stream, overlapping the previous step (``_copy_ahead``);
        # None: on where the step is captured (CUDA). The CPU runs the same path synchronously when asked.
        self.prefetch = capture if prefetch is None else prefetch
        self._copy_stream = None
        self._loss_sum: torch.Tensor | None = None  # accumulation's static sums (_start_sums)
        self.captures = 0  # CUDA graphs captured (one per batch shape, and the accumulated step's update)
        self.replays = 0  # graph replays, all steps
        self.replays_last_step = 0

    # -- static inputs ------------------------------------------------------------------------------
    def _key(self, batch) -> tuple:
        return tuple(tuple(getattr(batch, f).shape) for f in FIELDS) + (batch.max_src_len, batch.max_tgt_len)

    def stage(self, batch, n_tgt: int | None = None) -> dict[str, torch.Tensor]:
        """Copy ``batch`` (host, pinned) and the step's meta row (target tokens: ``n_tgt``, the whole step's with
        accumulation, else the batch's own; each group's lr) into this shape's static device buffers,
        asynchronous from pinned memory: directly (one ``_foreach_copy_``), or with ``prefetch`` through a
        staging set (``_copy_ahead``)."""
        key = self._key(batch)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = {f: torch.empty_like(getattr(batch, f), device=self.device) for f in FIELDS}
            bufs["meta"] = torch.zeros(1 + len(self.optimizer.param_groups), dtype=torch.float32, device=self.device)
            bufs["_key"] = key
            self._buffers[key] = bufs
        n_tgt = batch.num_target_tokens if n_tgt is None else n_tgt
        meta = torch.tensor([float(n_tgt)] + [float(g["lr"]) for g in self.optimizer.param_groups],
                            dtype=torch.float32)
        if self.device.type == "cuda":
            meta = meta.pin_memory()
        static = [bufs[f] for f in FIELDS] + [bufs["meta"]]
        host = [getattr(batch, f) for f in FIELDS] + [meta]
        if self.prefetch:
            self._copy_ahead(bufs, static, host)
        else:
            torch._foreach_copy_(static, host, non_blocking=True)
        bufs["_max"] = (batch.max_src_len, batch.max_tgt_len)
        return bufs

    def _copy_ahead(self, bufs: dict, static: list[torch.Tensor], host: list[torch.Tensor]) -> None:
        """The batch's host-to-device copy on a side stream into a staging set, then one device-to-device copy
        into the static buffers on the step's stream.

        The training loop hands the next batch over while the device still runs the previous step (the host is
        ahead once the step is a replay): the slow copy (host memory over PCIe) then overlaps that step, and the
        step's own stream pays only a device-local copy of ~100 KB. A staging set plus the static set (rather than
        two static sets, one graph captured per set) keeps one captured graph per shape: capture time and graph
        memory stay as without prefetching. Events order the reuse: the staging set is rewritten only after the
        previous device-to-device copy out of it ran, and the step's stream waits only for its own batch."""
        staging = bufs.get("_staging")
        if staging is None:
            staging = bufs["_staging"] = [torch.empty_like(t) for t in static]
        if not self.capture:  # no streams (the CPU): the same two copies, synchronous
            torch._foreach_copy_(staging, host)
            torch._foreach_copy_(static, staging)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        if "_copied" not in bufs:  # per staging set: its copy landed / the step's stream copied out of it
            bufs["_copied"], bufs["_consumed"] = torch.cuda.Event(), torch.cuda.Event()
        side, step_stream = self._copy_stream, torch.cuda.current_stream(self.device)
        copied, consumed = bufs["_copied"], bufs["_consumed"]
        side.wait_event(consumed)  # (an event never recorded: no wait)
        with torch.cuda.stream(side):
            torch._foreach_copy_(staging, host, non_blocking=True)
            copied.record(side)
        step_stream.wait_event(copied)
        torch._foreach_copy_(static, staging)
        consumed.record(step_stream)

    # -- the pure step ------------------------------------------------------------------------------
    def _forward_backward(self, bufs) -> torch.Tensor:
        inputs = {f: bufs[f] for f in FIELDS if f != "tgt_out"}
        max_src, max_tgt = bufs["_max"]
        with self.autocast:
            loss = self.loss_fn(bufs["tgt_out"], bufs["meta"][0], max_src_len=max_src, max_tgt_len=max_tgt, **inputs)
        # the gradients handed back as a tuple: no AccumulateGrad (a detach and a .grad write per parameter)
        grads = torch.autograd.grad(loss, self._params, allow_unused=True, materialize_grads=True)
        return loss.detach(), grads

    def _update(self, loss: torch.Tensor, meta: torch.Tensor, param_grads: tuple) -> torch.Tensor:
        """Gather, clip, guard and update: tensor ops only (compiled ``fullgraph=True`` when the run compiles).
        ``param_grads``: every parameter's gradient, in ``flat.params`` order."""
        with torch.no_grad():
            torch._foreach_copy_(self._views, list(param_grads))
        return self._apply(loss, meta)

    def _apply(self, loss: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """Clip, guard and update from the flat gradient buffers; returns the gradient norm."""
        flat = self.flat
        with torch.no_grad():
            grads = [f.grad for f in flat.flat]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            if self.grad_clip is not None:
                torch._foreach_mul_(grads, (self.grad_clip / (norm + 1e-6)).clamp(max=1.0))
            bad = (~(torch.isfinite(loss) & torch.isfinite(norm))).float() if self.guard else torch.zeros_like(norm)
            keep = 1.0 - bad
            for i, (params, states, betas, eps, wd) in enumerate(self._groups):  # not param_groups: its lr changes
                lr = meta[1 + i]
                for p, st in zip(params, states):
                    if self.name == "adamw":
                        adamw_update_(p, p.grad, st, lr=lr, betas=betas, eps=eps, weight_decay=wd, keep=keep)
                    else:
                        lion_step_reference(p, p.grad, st["exp_avg"], lr=lr, beta1=betas[0], beta2=betas[1],
                                            weight_decay=wd, found_inf=bad)
            self.counters.skipped.add_(bad)
            self.counters.nonfinite_in_row.add_(bad).mul_(bad)
        return norm

    def _step(self, bufs) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grads = self._forward_backward(bufs)
        norm = self.update(loss, bufs["meta"], grads)
        self.optimizer._opt_called = True  # (the LR scheduler checks the optimizer stepped before it)
        return loss, norm

    # -- gradient accumulation: k forward-backward calls into the flat gradients, then one update -------
    def _accumulate(self, bufs) -> torch.Tensor:
        """One micro-batch: its loss (already divided by the step's target tokens) and gradients added to the
        static sums. A non-finite micro-batch makes the sums non-finite: the update then skips the whole step."""
        loss, grads = self._forward_backward(bufs)
        with torch.no_grad():
            torch._foreach_add_(self._views, list(grads))
            self._loss_sum.add_(loss)
        return self._loss_sum

    def _update_sums(self) -> torch.Tensor:
        """The accumulated step's update, then the sums zeroed for the next step; returns the step's loss."""
        self.update_sums(self._loss_sum, self._step_meta)
        self.optimizer._opt_called = True
        loss = self._loss_sum.clone()
        with torch.no_grad():
            torch._foreach_zero_([f.grad for f in self.flat.flat] + [self._loss_sum])
        return loss

    # -- one call per training step -----------------------------------------------------------------
    def _run(self, key: tuple, fn):
        """``fn()`` on the CPU; on CUDA its first ``warmup`` calls for ``key`` eagerly on a side stream (real work:
        compiles, autotunes, allocates), the next captured as a CUDA graph, every later one a replay of it.
        Returns ``fn``'s output (a graph's static output: the caller copies what it keeps past the next replay)."""
        if not self.capture:
            return fn()
        graph = self._graphs.get(key)
        if graph is not None:
            graph[0].replay()
            self.replays += 1
            return graph[1]
        n = self._seen[key] = self._seen.get(key, 0) + 1
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        if n <= self.warmup:
            with torch.cuda.stream(side):
                out = fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._graphs[key] = (g, out)
        self.captures += 1
        g.replay()  # capture records without running: this call's work
        self.replays += 1
        return out

    def __call__(self, batches) -> torch.Tensor:
        """One optimizer step of ``batches`` (a packed host Batch, or a step's micro-batches); returns its loss per
        target token (device)."""
        if not isinstance(batches, (list, tuple)):
            batches = [batches]
        replays = self.replays
        # one micro-batch: the single-call step, until the run accumulates; from then on every step goes through
        # the sums (a one-batch step, e.g. an epoch's short last group, must not leave its gradients in them)
        if len(batches) == 1 and self._loss_sum is None:
            bufs = self.stage(batches[0])
            loss = self._run(("step",) + bufs["_key"], lambda: self._step(bufs)[0])
        else:
            n_tgt = sum(b.num_target_tokens for b in batches)  # python ints from the collate: no sync
            if self._loss_sum is None:
                self._start_sums()
            for b in batches:
                bufs = self.stage(b, n_tgt=n_tgt)
                self._run(("micro",) + bufs["_key"], lambda bufs=bufs: self._accumulate(bufs))
            # the update reads its lr row from its own buffer (the micro-batches' buffers are per shape)
            self._step_meta.copy_(bufs["meta"])
            loss = self._run(("update",), self._update_sums)
        self.replays_last_step = self.replays - replays
        return loss.clone() if self.capture else loss

    def _start_sums(self) -> None:
        """The accumulated step's static sums (made outside any graph): the flat gradients zeroed, a loss sum, the
        update's meta row, and the update (compiled like ``update`` when the run compiles)."""
        torch._foreach_zero_([f.grad for f in self.flat.flat])
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self._step_meta = torch.zeros(1 + len(self.optimizer.param_groups), dtype=torch.float32, device=self.device)
        self.update_sums = (torch.compile(self._apply, fullgraph=True, **self._compile_update)
                            if self._compile_update else self._apply)

    def graphs_per_step(self) -> int:
        """CUDA graphs replayed by the last step (1, or k + 1 with accumulation; 0 before capture and on the CPU)."""
        return self.replays_last_step

