"""LoRA on a mixture of experts (workers/trainer/moe_experts.py), on every MoE family's tiny model
(`loraplex/tiny-qwen3-moe`, `-mixtral`, `-olmoe`): the (adapter, expert) segment layout equals its plain
reference; two tenants in one pass get the bits each gets alone, though every expert's row count then
differs; the PEFT export (peft's target_parameters) loads in peft with the trainer's logprobs; a training
state carries the expert weights; and sampling is refused by name, never attempted. (Logprobs, gradients
and the AdamW step against peft, SFT and the drawn batch compositions: test_architectures.py's MoE rows.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import ForwardBackwardInput
from models.architectures import ARCHITECTURES, MOE_SAMPLING
from models.registry import model_info, resolve_model
from tests.workers.trainer.peft_reference import random_datum, rel_err, target_logprobs
from tests.workers.trainer.test_engine_parity import make_engine
from workers.trainer.lora_layers import RoutingPlan
from workers.trainer.moe_experts import MultiLoRAExperts, reference_experts, routed_experts

# every MoE family's tiny model: the experts code is shared, their routers and attention differ
MOE_MODELS = sorted(a.tiny for a in ARCHITECTURES.values() if a.moe)
ADAPTERS = {"a": LoraConfig(rank=4, alpha=16, seed=1, train_unembed=False),
            "b": LoraConfig(rank=2, alpha=4, seed=2, train_attn=False, train_unembed=False)}
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


@pytest.fixture(scope="module", params=MOE_MODELS)
def moe(request):
    return request.param


@pytest.fixture(scope="module")
def moe_path(moe):
    return resolve_model(moe)


def requests(vocab: int) -> dict[str, ForwardBackwardInput]:
    gen = torch.Generator().manual_seed(5)
    return {"a": ForwardBackwardInput("a", [random_datum("cross_entropy", n, gen, vocab) for n in (2, 1)]),
            "b": ForwardBackwardInput("b", [random_datum("ppo", n, gen, vocab) for n in (40, 33)], "ppo")}


def test_the_segment_layout_equals_its_plain_reference(moe_path):
    engine = make_engine(moe_path, ADAPTERS)
    experts = next(m for m in engine.model.modules() if isinstance(m, MultiLoRAExperts))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(23, engine.model.config.hidden_size, generator=gen)
    _, weights, index = engine.model.model.layers[0].mlp.gate(x)
    a, b = engine.adapter("a"), engine.adapter("b")
    # rows 0-9 adapter a (two requests' pieces), 10-19 b, 20-22 no adapter
    plan = RoutingPlan([(a, 0, 10), (b, 10, 20)], pieces=[((0, 4), (4, 10)), ((10, 20),)])
    ours = routed_experts(x, index, weights, experts.base, plan, experts.paths)
    loras = [(start, end, {p: (w.weights[p].lora_a, w.weights[p].lora_b) for p in experts.paths}, w.scale)
             for w, start, end in plan.spans]
    reference = reference_experts(x, index, weights, experts.base, loras, experts.paths)
    assert rel_err(ours, reference) <= 1e-5
    plain = reference_experts(x, index, weights, experts.base, [], experts.paths)
    assert rel_err(ours[20:], plain[20:]) <= 1e-6 and rel_err(ours[:20], plain[:20]) > 1e-3  # LoRA only on spans
    assert len(set(index.flatten().tolist())) == experts.base.num_experts  # every expert has rows


def run(moe_path, names: list[str]):
    """Fresh adapters (the same seeds, the same B), one forward_backward of `names`' requests, one step."""
    engine = make_engine(moe_path, ADAPTERS)
    reqs = requests(engine.vocab_size)
    results = dict(zip(names, engine.forward_backward([reqs[n] for n in names])))
    grads = {n: engine.adapter(n).flat_grads.clone() for n in names}
    engine.optim_step([(n, ADAM) for n in names])
    return {n: (results[n], grads[n], engine.adapter(n).flat_weights.clone()) for n in names}


def test_two_tenants_in_one_pass_get_the_bits_each_gets_alone(moe_path):
    """Alone, request a's 8 tokens give each expert a few rows (MKL's few-row kernels); beside b's 73,
    tens. Logprobs, loss, gradients and post-AdamW weights must still be the same bits."""
    together = run(moe_path, ["a", "b"])
    for name in ("a", "b"):
        alone = run(moe_path, [name])[name]
        (r1, g1, w1), (r2, g2, w2) = alone, together[name]
        assert r1.metrics["loss:sum"] == r2.metrics["loss:sum"]
        for o1, o2 in zip(r1.loss_fn_outputs, r2.loss_fn_outputs):
            assert torch.equal(o1["logprobs"], o2["logprobs"])
        assert torch.equal(g1, g2) and torch.equal(w1, w2)
        assert g1.abs().sum() > 0


def test_the_peft_export_loads_in_peft_with_the_trainers_logprobs(moe_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from storage.peft_export import export_peft_from_state

    engine = make_engine(moe_path, ADAPTERS)
    reqs = requests(engine.vocab_size)
    engine.forward_backward(list(reqs.values()))
    engine.optim_step([(n, ADAM) for n in reqs])
    for name, request in reqs.items():
        snapshot = engine.save_sampler_weights(name, tmp_path / f"{name}-sampler")
        state = engine.save_state(name, tmp_path / f"{name}-state")
        exported = export_peft_from_state(state, tmp_path / f"{name}-exported", moe_path)
        ours = engine.forward([request])[0].loss_fn_outputs
        for folder in (snapshot, exported):
            base = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32, attn_implementation="eager")
            model = PeftModel.from_pretrained(base, folder).eval()
            loaded = {n for n, _ in model.named_parameters() if "lora_" in n}
            assert any(".experts." in n for n in loaded) and len(loaded) == 2 * len(engine.adapter(name).weights)
            with torch.no_grad():
                for datum, out in zip(request.data, ours):
                    peft_lp = target_logprobs(model, datum.tokens, datum.loss_fn_inputs["target_tokens"])
                    assert rel_err(out["logprobs"], peft_lp) <= 1e-5


def test_a_training_state_carries_the_expert_weights(moe_path, tmp_path):
    engine = make_engine(moe_path, ADAPTERS)
    request = requests(engine.vocab_size)["a"]
    engine.forward_backward([request])
    engine.optim_step([("a", ADAM)])
    engine.forward_backward([request])  # pending gradients too
    path = engine.save_state("a", tmp_path / "state", with_gradients=True)
    restored = make_engine(moe_path, {}).load_state("a", path)
    original = engine.adapter("a")
    assert restored.layout() == original.layout()
    assert any(w.lora_a.dim() == 3 for w in restored.weights.values())
    for kind in ("flat_weights", "flat_grads"):
        assert torch.equal(getattr(restored, kind), getattr(original, kind))
    for key, value in original.optimizer_state.items():
        assert torch.equal(restored.optimizer_state[key], value)


def test_sampling_on_a_moe_base_model_is_refused_by_name(moe, tmp_path):
    from api.app import create_app
    from api.served_models import ServedModel, ServedModels
    from db.session import make_engine as db_engine
    from db.session import make_session_factory, upgrade_to_head
    from db.tenants import create_tenant
    from messaging.notify import Notifier
    from service.embedded import build_sampling
    from service.settings import Settings

    info = model_info(moe)
    settings = Settings(data_dir=tmp_path, base_model=moe)
    upgrade_to_head(settings.resolved_database_url)
    sessions = make_session_factory(db_engine(settings.resolved_database_url))
    sampling, unavailable = build_sampling(settings, info, sessions, Notifier())
    assert sampling is None and unavailable == MOE_SAMPLING
    app = create_app(settings=settings, sessions_factory=sessions, notifier=Notifier(), models=ServedModels(
        [ServedModel(info, SimpleNamespace(submit=lambda q: None), sampling_unavailable=unavailable)]))
    with sessions() as s:
        key = create_tenant(s, "moe")[1]
    with TestClient(app, base_url="http://test", headers={"x-api-key": key}) as client:
        session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
        answer = client.post("/api/v1/create_sampling_session",
                             json={"session_id": session_id, "sampling_session_seq_id": 0})
        assert answer.status_code == 400 and "mixture-of-experts" in answer.text, answer.text
        answer = client.post("/api/v1/asample", json={"prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                                                      "num_samples": 1, "sampling_params": {"max_tokens": 2},
                                                      "base_model": moe})
        assert answer.status_code == 400 and "mixture-of-experts" in answer.text, answer.text


def test_dimuon_steps_each_experts_matrices_and_lowers_the_loss(moe_path):
    """Dimuon orthogonalises each [r, d] matrix: an expert parameter's A [E, r, in] is E of them."""
    from loraplex.types import DimuonParams

    engine = make_engine(moe_path, {})
    adapter = engine.create_adapter("d", LoraConfig(rank=4, train_unembed=False), optimizer="dimuon")
    request = ForwardBackwardInput("d", [random_datum("cross_entropy", 20, torch.Generator().manual_seed(0), 512)])
    losses = []
    for _ in range(4):
        losses.append(engine.forward_backward([request])[0].metrics["loss:sum"])
        engine.optim_step([("d", DimuonParams(learning_rate=1e-2))])
    assert losses[-1] < 0.9 * losses[0], losses
    b = adapter.weights["model.layers.0.mlp.experts.down_proj"].lora_b
    assert (b.detach().abs().sum(dim=(1, 2)) > 0).all()  # every expert trained


@pytest.mark.parametrize("unembed", [False, True])
def test_adapters_of_one_layout_stack_their_linear_layers_and_equal_peft(moe_path, unembed, monkeypatch):
    """Two adapters of one layout take the stacked bmm path (stacked_adapters.py) on their Linear layers; their
    expert weights are not stacked (moe_experts.py reads them) and every number still equals peft's."""
    from tests.workers.trainer.test_engine_parity import check_against_peft
    from workers.trainer.stacked_adapters import StackedAdapters

    stacked = []
    for_pass = StackedAdapters.for_pass.__func__

    def recording(cls, *args, **kwargs):
        stacked.append(for_pass(cls, *args, **kwargs))
        return stacked[-1]

    monkeypatch.setattr(StackedAdapters, "for_pass", classmethod(recording))
    engine = make_engine(moe_path, {name: LoraConfig(rank=4, alpha=alpha, seed=i, train_unembed=unembed)
                                    for i, (name, alpha) in enumerate((("x", 8.0), ("y", 16.0)))})
    gen = torch.Generator().manual_seed(1)
    reqs = [ForwardBackwardInput(n, [random_datum("cross_entropy", k, gen, 512) for k in (30, 20)]) for n in "xy"]
    check_against_peft(engine, reqs, moe_path)
    assert stacked and all(s is not None and not any(".experts." in p for p in s.paths) for s in stacked)


def test_the_merged_export_gives_the_trainers_logprobs(moe, moe_path, tmp_path):
    """save_weights_external merges with peft's merge_and_unload: every expert's B A lands in its own slice."""
    from transformers import AutoModelForCausalLM

    from storage.external_weights import MERGED

    engine = make_engine(moe_path, ADAPTERS)
    request = requests(engine.vocab_size)["a"]
    export = engine.save_external_weights("a", tmp_path / "external", moe)
    merged = AutoModelForCausalLM.from_pretrained(export / MERGED, dtype=torch.float32, attn_implementation="eager")
    base = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    moved = (merged.model.layers[0].mlp.experts.gate_up_proj - base.model.layers[0].mlp.experts.gate_up_proj)
    assert (moved.abs().sum(dim=(1, 2)) > 0).all()  # every expert's weights changed
    ours = engine.forward([request])[0].loss_fn_outputs
    with torch.no_grad():
        for datum, out in zip(request.data, ours):
            lp = target_logprobs(merged, datum.tokens, datum.loss_fn_inputs["target_tokens"])
            assert rel_err(out["logprobs"], lp) <= 1e-5


def test_the_official_sdk_trains_a_moe_model_and_is_told_sampling_is_refused(moe, tmp_path):
    """A served MoE, end to end with the tinker SDK: SFT steps lower the loss; a sampler of the saved weights
    answers a 400 naming the limitation, not a failure inside vLLM."""
    import tinker
    from tinker import types

    from tests.servers import running_server

    with running_server(tmp_path, base_model=moe) as server:
        assert server.embedded.sampling is None  # no vLLM engine started for it
        service = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
        training = service.create_lora_training_client(base_model=moe, rank=8)
        tokens = list(range(3, 40))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        losses = []
        for _ in range(4):
            losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[-1] < 0.9 * losses[0], losses
        sampler = training.save_weights_and_get_sampling_client("s1")
        with pytest.raises(tinker.BadRequestError, match="no LoRA for the expert layers of mixture-of-experts"):
            sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()


def test_requests_that_others_split_into_other_passes_keep_their_bits(moe_path):
    """Adapter a's two requests share one pass alone; beside b's request (between them, 48-token passes)
    each lands in a pass of its own. Its expert gradients still add the same per-request pieces in order."""
    from workers.trainer.engine import TrainerEngine

    gen = torch.Generator().manual_seed(9)
    a1, a2 = ([random_datum("cross_entropy", 19, gen, 512)] for _ in range(2))
    b = [random_datum("cross_entropy", 29, gen, 512)]

    def gradients(requests):
        engine = TrainerEngine(moe_path, max_pass_tokens=48)
        init = torch.Generator().manual_seed(123)
        for name, cfg in ADAPTERS.items():
            with torch.no_grad():  # a non-zero B, so that A's gradients are not zero
                for w in engine.create_adapter(name, cfg).weights.values():
                    w.lora_b.copy_(0.1 * torch.randn(w.lora_b.shape, generator=init))
        engine.forward_backward(requests)
        return engine.adapter("a").flat_grads

    alone = gradients([ForwardBackwardInput("a", a1), ForwardBackwardInput("a", a2)])
    beside = gradients([ForwardBackwardInput("a", a1), ForwardBackwardInput("b", b), ForwardBackwardInput("a", a2)])
    assert (alone != 0).float().mean() > 0.9 and torch.equal(alone, beside)
