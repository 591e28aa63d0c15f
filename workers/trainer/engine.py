"""The trainer engine: one frozen base model, many tenants' adapters, batched passes.

`forward_backward` takes requests of many adapters, validates each one on its own (a bad one
fails alone, before any state changes), packs all valid datums into one token row grouped by
adapter, runs the base model once with every token routed through its own adapter (SGMV),
computes each request's loss and backpropagates the sum. Each adapter's gradient depends only on
its own tokens, so the batched result equals each request run alone. Datums of one request that
begin alike (an RL group's prompt) compute that beginning once (`shared_prefix`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from contract.configs import LoraConfig, OptimParams, check_optim_params, optimizer_of
from contract.errors import EngineError, InvalidInputError, UnknownAdapterError
from contract.inputs import ForwardBackwardInput
from models.architectures import check_lora_config
from models.registry import DEFAULT_CACHE_DIR, resolve_model
from storage.external_weights import write_external_weights
from workers.cpu_threads import intra_op_threads
from workers.host_memory import retain_freed_host_memory
from workers.sgmv import row_gemm
from workers.trainer import checkpoints
from workers.trainer.adapters import OPTIMIZER_STATE, Adapter
from workers.trainer.batch import EngineOutput, PackedBatch, PreparedRequest, pack, prepare_request, split_into_passes
from workers.trainer.lora_layers import Router, RoutingPlan, wrap_linear_layers
from workers.trainer.moe_experts import wrap_moe_experts
from workers.trainer.dimuon import dimuon_step
from workers.trainer.optimizer import adamw_step
from workers.trainer.packed_attention import ATTN_IMPLEMENTATION, LAYOUT_KWARG
from workers.trainer.parts import merge_metrics
from workers.trainer.pass_losses import pass_losses
from workers.trainer.shared_prefix import MIN_SHARED_TOKENS
from workers.trainer.stacked_adapters import StackedAdapters

# A CPU pass of fewer multiply-adds (rows x base parameters) than this runs on one thread. Its ops
# are then too small to share: waking the other OpenMP thread and waiting for it at every op costs
# more than it saves, the more so beside a server's other threads. Forward_backward + optim_step
# on a thread of a process running vLLM, one thread against two (median of 15): `tiny` (0.14M
# parameters) at 32 to 1,024 tokens 0.72-0.84x the time; SmolLM2-135M at 8 tokens 0.93x, at 32
# tokens 1.21x (there two threads win). It still holds with the embedded server's one compute
# thread (one team, workers/compute_thread.py), though not in a quiet process: its API and
# scheduler threads keep the other core busy. benchmarks/service_overhead.py on a 2-core VM
# (2026-12-02), added per SDK call: 10.5-10.7 ms with this rule, 11.8-13.6 ms with two threads
# for every pass; a lone thread running only `tiny` rounds: two threads 0.84-1.0x the time.
PARALLEL_MIN_MACS = 2e9


class TrainerEngine:
    def __init__(
        self,
        base_model: str | Path = "tiny",
        *,
        max_rank: int = 64,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        cache_dir: str | Path = DEFAULT_CACHE_DIR,
        sgmv_backend: str = "auto",
        max_pass_tokens: int = 512,
        min_shared_prefix: int = MIN_SHARED_TOKENS,
        parallel_min_macs: float = PARALLEL_MIN_MACS,
        keep_glibc_malloc_defaults: bool = False,
    ) -> None:
        retain_freed_host_memory(keep_glibc_malloc_defaults)  # before the model loads: passes then reuse warm pages
        self.model_path = resolve_model(str(base_model), cache_dir)
        self.base_model_name = str(base_model)
        self.max_rank = max_rank
        # Larger passes are not faster on CPU: at 2,048 tokens a LoRA pass of SmolLM2 ran ~25% slower
        # per token than 8 passes of 256 (the [tokens, vocab] buffers no longer stay warm).
        self.max_pass_tokens = max_pass_tokens
        # datums of one request that begin with this many equal tokens compute them once (0: never)
        self.min_shared_prefix = min_shared_prefix
        self.dtype = dtype
        self.device = torch.device(device)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).to(self.device)
        self.model.eval()  # no dropout: results must be deterministic and batch invariant
        self.model.requires_grad_(False)
        self.router = Router(sgmv_backend)
        self.base_layers = wrap_linear_layers(self.model, self.router)
        # a sparse block's fused expert parameters, after the Linear layers (a dense model's layout is unchanged)
        self.base_layers.update(wrap_moe_experts(self.model, self.router))
        self.parallel_min_macs = parallel_min_macs
        self._base_parameters = sum(p.numel() for p in self.model.parameters())
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_seq_len = self.model.config.max_position_embeddings
        self.adapters: dict[str, Adapter] = {}
        # called after each pass of a forward_backward: where a process that runs the sampler on
        # the same thread lets its steps in (workers/compute_thread.py)
        self.between_passes: Callable[[], None] | None = None

    # --- adapters --------------------------------------------------------------------------------

    def create_adapter(self, adapter_id: str, config: LoraConfig | None = None, optimizer: str = "adamw") -> Adapter:
        """A new adapter; `optimizer` ("adamw" or "dimuon") is fixed for its life (docs/optimizers.md)."""
        config = config or LoraConfig()
        config.validate(self.max_rank)
        check_lora_config(self.model.config.model_type, config)
        if optimizer not in OPTIMIZER_STATE:
            raise InvalidInputError("optimizer_config.type", f"unknown optimizer {optimizer!r}")
        if adapter_id in self.adapters:
            raise InvalidInputError("adapter_id", f"adapter {adapter_id!r} already exists")
        adapter = Adapter.create(adapter_id, config, self.base_layers, self.dtype, optimizer)
        self.adapters[adapter_id] = adapter
        return adapter

    def delete_adapter(self, adapter_id: str) -> None:
        if self.adapters.pop(adapter_id, None) is None:
            raise UnknownAdapterError(adapter_id)

    def adapter(self, adapter_id: str) -> Adapter:
        try:
            return self.adapters[adapter_id]
        except KeyError:
            raise UnknownAdapterError(adapter_id) from None

    # --- forward / backward ----------------------------------------------------------------------

    def forward(self, requests: list[ForwardBackwardInput]) -> list[EngineOutput | EngineError]:
        return self.forward_backward([replace(r, forward_only=True) for r in requests])

    def forward_backward(
        self, requests: list[ForwardBackwardInput]
    ) -> list[EngineOutput | EngineError]:
        """One batched pass over many adapters' requests; results (or errors) in request order."""
        results: list[EngineOutput | EngineError | None] = [None] * len(requests)
        prepared: list[PreparedRequest] = []
        for i, request in enumerate(requests):
            try:
                self.adapter(request.adapter_id)
                prepared.append(prepare_request(i, request, self.vocab_size, self.max_seq_len))
            except InvalidInputError as e:
                results[i] = e
        if prepared:
            for p, out in zip(prepared, self._run(prepared)):
                results[p.index] = out
        return results  # type: ignore[return-value]

    def _run(self, prepared: list[PreparedRequest]) -> list[EngineOutput]:
        """Run the batch in passes of at most `max_pass_tokens` tokens (gradients accumulate
        across passes as across calls) and put each request's pieces back together."""
        logprobs = {p.index: [None] * len(p.tokens) for p in prepared}
        pass_metrics: dict[int, list[tuple[dict[str, float], int]]] = {p.index: [] for p in prepared}
        for pieces in split_into_passes(prepared, self.max_pass_tokens, self.min_shared_prefix):
            for piece, out in zip(pieces, self._pass(pieces)):
                pass_metrics[piece.index].append((out.metrics, len(piece.datum_ids)))
                for d, lp in zip(piece.datum_ids, out.loss_fn_outputs):
                    logprobs[piece.index][d] = lp
            if self.between_passes is not None:
                self.between_passes()
        return [
            EngineOutput(logprobs[p.index], merge_metrics(pass_metrics[p.index]), pass_metrics[p.index])
            for p in prepared
        ]

    def _pass(self, prepared: list[PreparedRequest]) -> list[EngineOutput]:
        """One packed forward (and backward) over all tokens of `prepared`."""
        batch = pack(prepared, self.min_shared_prefix)
        needs_grad = any(not p.request.forward_only for p in prepared)
        with intra_op_threads(self.pass_threads(batch.input_ids.numel())):
            batch = self._padded(batch)
            spans = [(self.adapters[a], start, end) for a, start, end in batch.adapter_spans]
            pieces = span_pieces(batch, prepared, [(start, end) for _, start, end in spans])
            stacked = StackedAdapters.for_pass(spans, batch.input_ids.numel(), needs_grad, self.device, pieces,
                                               row_gemm.min_rows())
            return self._packed_pass(prepared, batch, RoutingPlan(spans, stacked, pieces), needs_grad)

    def pass_threads(self, rows: int) -> int | None:
        """Intra-op threads for a pass over `rows` token rows: one for a small CPU pass, else
        None (torch's default). One thread and two give every row the same bits (rows padded to
        row_gemm.min_rows()); more threads were not measured, so there every pass takes the default."""
        if self.device.type != "cpu" or rows * self._base_parameters >= self.parallel_min_macs:
            return None
        if torch.get_num_threads() > 2:
            return None
        return 1

    def _padded(self, batch: PackedBatch) -> PackedBatch:
        """The batch with rows of no datum appended up to row_gemm.min_rows(): MKL computes a
        product of fewer rows with other kernels, which would give a lone short request other bits
        than it gets beside others (workers/sgmv/row_gemm.py)."""
        n, need = batch.input_ids.numel(), row_gemm.min_rows()
        if self.device.type != "cpu" or n >= need:
            return batch
        return replace(batch, input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(need - n)]),
                       position_ids=torch.cat([batch.position_ids, torch.arange(need - n)]),
                       layout=batch.layout.padded(n, need - n))

    def _packed_pass(self, prepared: list[PreparedRequest], batch: PackedBatch, plan: RoutingPlan,
                     needs_grad: bool) -> list[EngineOutput]:
        with torch.set_grad_enabled(needs_grad):
            outputs, total_loss = pass_losses(prepared, batch, self.target_logprobs(batch, plan))
        if total_loss is not None:
            total_loss.backward()  # gradients accumulate into each adapter's own .grad
            for adapter, _, _ in plan.spans:
                adapter.gradients_pending = True
        return outputs

    def target_logprobs(self, batch: PackedBatch, plan: RoutingPlan) -> Tensor:
        """log p(target) for every datum position and target column of the packed batch: [P, K_max].

        One gather over the whole batch: per-request indexing of the [T, vocab] logits would
        make the backward materialise a [T, vocab] gradient once per request."""
        self.router.plan = plan
        try:
            logits = self.model(
                input_ids=batch.input_ids[None].to(self.device),
                position_ids=batch.position_ids[None].to(self.device),
                use_cache=False,
                **{LAYOUT_KWARG: batch.layout.to(self.device)},
            ).logits[0]
        finally:
            self.router.plan = None
        # log_softmax + gather: its backward is one fused pass over [T, vocab], where
        # logsumexp's takes several (sub, exp, mul, add), each allocating a [T, vocab] tensor.
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = batch.targets.to(self.device)
        if batch.position_rows is None:
            return logprobs.gather(1, targets)
        # shared rows serve several datums, each with its own targets: index the flat [T * vocab]
        flat = batch.position_rows.to(self.device)[:, None] * logprobs.shape[1] + targets
        return logprobs.flatten()[flat]

    # --- optimizer -------------------------------------------------------------------------------

    def optim_step(self, steps: list[tuple[str, OptimParams]]) -> list[dict[str, float] | EngineError]:
        """One step on many adapters in one call, each with its own optimizer (the one it was created
        with: params of another family fail that adapter alone), hyperparameters and step count."""
        results: list[dict[str, float] | EngineError | None] = [None] * len(steps)
        valid: list[tuple[int, Adapter, OptimParams]] = []
        for i, (adapter_id, params) in enumerate(steps):
            try:
                check_optim_params(params)
                adapter = self.adapter(adapter_id)
                if optimizer_of(params) != adapter.optimizer:
                    raise InvalidInputError("optimizer_params.type", (
                        f"this model was created with {adapter.optimizer}, so its steps take {adapter.optimizer}'s "
                        f"hyperparameters, not {optimizer_of(params)}'s (docs/optimizers.md)"))
                valid.append((i, adapter, params))
            except InvalidInputError as e:
                results[i] = e
        while valid:  # an adapter listed twice steps twice: its second step goes in a later call
            batch, seen, later = [], set(), []
            for item in valid:
                (later if id(item[1]) in seen else batch).append(item)
                seen.add(id(item[1]))
            for family, step in (("adamw", adamw_step), ("dimuon", dimuon_step)):
                mine = [item for item in batch if item[1].optimizer == family]
                if not mine:
                    continue
                for (i, _, _), metrics in zip(mine, step([(adapter, params) for _, adapter, params in mine])):
                    results[i] = metrics
            valid = later
        return results  # type: ignore[return-value]

    # --- checkpoints -----------------------------------------------------------------------------

    def save_sampler_weights(self, adapter_id: str, path: str | Path) -> Path:
        """A PEFT folder, plus the policy version it is: the optimizer steps applied so far."""
        adapter = self.adapter(adapter_id)
        metadata = {"policy_version": adapter.step, "adapter_id": adapter_id}
        return checkpoints.save_peft_adapter(adapter, path, self.model_path, metadata)

    def save_external_weights(self, adapter_id: str, path: str | Path, base_model: str,
                              age_recipients: list[str] | None = None) -> Path:
        """The adapter merged into the base model, a Hugging Face folder, beside its PEFT adapter
        (storage/external_weights.py; `base_model`: the name users know the base by; `age_recipients`:
        encrypt every file to them)."""
        with tempfile.TemporaryDirectory(prefix="loraplex-export-") as tmp:
            adapter = self.save_sampler_weights(adapter_id, Path(tmp) / "adapter")
            return write_external_weights(Path(adapter), path, self.model_path, base_model, age_recipients)

    def save_state(self, adapter_id: str, path: str | Path, extra: dict | None = None, *,
                   with_gradients: bool = False) -> Path:
        return checkpoints.save_training_state(self.adapter(adapter_id), path, extra, with_gradients=with_gradients)

    def load_state(self, adapter_id: str, path: str | Path, *, with_optimizer: bool = True,
                   optimizer: str | None = None, read: tuple[dict, dict] | None = None) -> Adapter:
        """Create (or replace) `adapter_id` from a training-state checkpoint: with its optimizer and that
        optimizer's state, or (with_optimizer=False) its weights and a fresh `optimizer` (AdamW when None).
        `read`: the checkpoint's manifest and tensors, already read and verified (a prefetched page-in)."""
        adapter = checkpoints.load_training_state(
            adapter_id, path, self.base_layers, self.dtype, self.max_rank, with_optimizer=with_optimizer,
            optimizer=optimizer, read=read,
        )
        self.adapters[adapter_id] = adapter
        return adapter


def span_pieces(batch: PackedBatch, prepared: list[PreparedRequest],
                spans: list[tuple[int, int]]) -> list[tuple[tuple[int, int], ...]]:
    """The rows of each request in each adapter's span, in order: the pieces its weight gradients
    add one by one (workers/sgmv/grad_pieces.py). A request's rows begin at its first datum's
    first position (a datum that begins a request shares no rows)."""
    first_rows = []
    for p in prepared:
        position = batch.datum_offsets[p.index][0]
        first_rows.append(int(batch.position_rows[position]) if batch.position_rows is not None else position)
    first_rows.sort()
    pieces = []
    for start, end in spans:
        starts = [row for row in first_rows if start <= row < end]
        pieces.append(tuple(zip(starts, [*starts[1:], end])))
    return pieces
