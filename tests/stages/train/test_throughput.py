"""Exactness of the throughput paths: padding-free packing and logits only at loss positions.

Every faster path must give the loss and the gradients of the plain one (full logits over a
padded batch) to float tolerance, on examples of unequal lengths, plain and with peft LoRA.
The speed itself is measured by benchmarks/throughput.py, not here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.throughput import VOCAB, examples, lora, tiny_llama
from tunelab.core.config_training import TrainingConfig
from tunelab.stages.train import attention, losses
from tunelab.stages.train.batches import DataOrder, StepSource, collate, count_loss_tokens
from tunelab.stages.train.loop import (
    Loop,
    TrainState,
    autocast,
    build_optimizer,
    build_scheduler,
    to_device,
    train_loop,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_loss_sum(model, batch) -> torch.Tensor:
    """The plain computation: full logits of a padded batch, cross-entropy at loss positions."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    return F.cross_entropy(logits[:, :-1][keep].float(), labels[keep], reduction="sum")


def loss_and_grads(model, fn) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same(a: tuple, b: tuple, tol: float = 1e-5) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=tol, abs=tol)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        scale = 1.0 + grads_a[name].abs().max().item()
        diff = (grads_a[name] - grads_b[name]).abs().max().item()
        assert diff <= tol * scale, f"{name}: gradient differs by {diff}"


@pytest.mark.parametrize("adapter", [None, "lora"])
@pytest.mark.parametrize("route", ["split", "hook", "full"])
def test_packed_loss_position_logits_equal_padded_full_logits(adapter, route):
    model = tiny_llama()
    if adapter:
        model = lora(model)
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    packed = collate(batch, 0, "causal_lm", packing=True)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert count_loss_tokens(packed) == count_loss_tokens(padded)
    expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
    if adapter:
        assert all("lora" in n for n in expected[1])
    for b in (padded, packed):
        got = loss_and_grads(model, lambda b=b: losses.causal_lm_loss_sum(model, b, route=route))
        assert_same(got, expected)


def test_best_route_is_split_and_a_wrong_packing_would_be_caught():
    model = tiny_llama()
    packed = collate(examples(), 0, "causal_lm", packing=True)
    assert losses.choose_route(model, packed["input_ids"]) == "split"
    assert losses.packing_is_exact(model, packed["input_ids"])
    # The same packed row without its restarting positions lets examples attend to each other:
    # the loss differs by far more than the tolerance of the equality tests (1e-5).
    leaky = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).unsqueeze(0))
    with torch.no_grad():
        right = losses.causal_lm_loss_sum(model, packed).item()
        wrong = losses.causal_lm_loss_sum(model, leaky).item()
    assert abs(right - wrong) > 20 * 1e-5 * abs(right)


def test_lora_on_lm_head():
    model = lora(tiny_llama(), targets=("q_proj", "v_proj", "lm_head"))
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    packed = collate(batch, 0, "causal_lm", packing=True)
    expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
    assert any("lm_head.lora" in n for n in expected[1])
    assert losses.choose_route(model, packed["input_ids"]) == "split"
    got = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    assert_same(got, expected)


@pytest.mark.parametrize("adapter", [None, "lora_head"])
def test_chunked_cross_entropy_equals_unchunked(adapter):
    model = tiny_llama()
    if adapter:
        model = lora(model, targets=("q_proj", "lm_head"))
    packed = collate(examples(8), 0, "causal_lm", packing=True)
    n = count_loss_tokens(packed)
    whole = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    # chunks of 7 rows, the last one short
    chunked = loss_and_grads(
        model, lambda: losses.causal_lm_loss_sum(model, packed, chunk_logits=7 * VOCAB)
    )
    assert n > 7 * 3 and n % 7
    assert_same(chunked, whole)


def saved_numel(fn) -> int:
    """Elements of the tensors autograd saves while `fn()` runs (parameters included)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def test_chunked_head_holds_one_chunk_of_logits_alive():
    """A LoRA head runs in chunks recomputed in backward: far less is saved than unchunked."""
    model = lora(tiny_llama(), targets=("q_proj", "lm_head"))
    head = model.get_base_model().get_output_embeddings()
    assert losses.cross_entropy_kind(head, torch.device("cpu")) == "chunked"
    hidden = torch.randn(400, 32, requires_grad=True)
    targets = torch.randint(0, VOCAB, (400,))

    def run(chunk):
        return saved_numel(lambda: losses.cross_entropy_sum(head, hidden, targets, chunk))

    assert run(50 * VOCAB) < run(10**9) / 4


def test_fused_loss_keeps_no_logits():
    """The fused loss keeps the gradient of the hidden states and nothing of [n, vocab]."""
    head = tiny_llama().get_output_embeddings()
    head.weight.requires_grad_(False)  # frozen, as under LoRA
    hidden = torch.randn(400, 32, requires_grad=True)
    targets = torch.randint(0, VOCAB, (400,))
    assert losses.cross_entropy_kind(head, torch.device("cpu")) == "fused"
    fused = saved_numel(lambda: losses.cross_entropy_sum(head, hidden, targets))
    plain = saved_numel(lambda: F.cross_entropy(head(hidden).float(), targets, reduction="sum"))
    assert fused == hidden.numel()
    assert plain >= 400 * VOCAB


def fused_and_plain(n, bias, train_weight, chunk_rows, precision="fp32", scale=0.37, seed=0):
    """(loss, grads) of the fused loss and of F.linear + F.cross_entropy on the same tensors."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 32, generator=gen) * 2
    weight = torch.randn(VOCAB, 32, generator=gen) / 2
    b = torch.randn(VOCAB, generator=gen) if bias else None
    targets = torch.randint(0, VOCAB, (n,), generator=gen)

    def run(fused: bool):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)]
        leaves.append(b.clone().requires_grad_(train_weight) if bias else None)
        h, w, bb = leaves
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if fused:
                loss = losses.linear_cross_entropy_sum(h, w, bb, targets, chunk_rows)
            else:
                loss = F.cross_entropy(F.linear(h, w, bb).float(), targets, reduction="sum")
        (loss * scale).backward()
        grads = {name: t.grad for name, t in zip("hwb", leaves, strict=True) if t is not None}
        return loss.item(), {k: g for k, g in grads.items() if g is not None}

    return run(True), run(False)


def max_rel_diff(a: tuple, b: tuple) -> float:
    """The largest difference of loss and gradients, relative to each tensor's scale."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    diffs = [abs(loss_a - loss_b) / (1 + abs(loss_b))]
    for k in grads_a:
        diffs.append(
            float((grads_a[k] - grads_b[k]).abs().max()) / (1 + float(grads_b[k].abs().max()))
        )
    return max(diffs)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("train_weight", [False, True])
@pytest.mark.parametrize("chunk_rows", [1000, 7, 1])
def test_fused_linear_cross_entropy_equals_linear_then_cross_entropy(
    bias, train_weight, chunk_rows
):
    """Loss and gradients (hidden, weight, bias; scaled by a factor in backward, as the loop
    divides by the loss tokens) equal the plain computation in fp32, in one chunk or many
    (chunks of 7 rows: the last one short)."""
    fused, plain = fused_and_plain(45, bias, train_weight, chunk_rows)
    assert set(fused[1]) == (
        {"h", "w", "b"} if train_weight and bias else {"h", "w"} if train_weight else {"h"}
    )
    assert max_rel_diff(fused, plain) < 1e-5


def test_fused_linear_cross_entropy_in_bf16_autocast_matches_autocast_linear():
    """Under bf16 autocast the fused loss makes its logits in bf16 as F.linear does: it differs
    from autocast's own F.linear + cross-entropy by bf16 rounding, not more."""
    fused, plain = fused_and_plain(60, True, True, 7, precision="bf16")
    fp32_fused, _ = fused_and_plain(60, True, True, 7, precision="fp32")
    assert max_rel_diff(fused, plain) < 2e-2
    # and bf16 is really in use: the bf16 loss is not the fp32 one
    assert fused[0] != pytest.approx(fp32_fused[0], rel=1e-6)


def test_fused_loss_without_gradients_is_the_same_loss():
    head = tiny_llama().get_output_embeddings()
    hidden = torch.randn(50, 32)
    targets = torch.randint(0, VOCAB, (50,))
    with torch.no_grad():
        fused = losses.cross_entropy_sum(head, hidden, targets, chunk_logits=7 * VOCAB)
        plain = F.cross_entropy(head(hidden), targets, reduction="sum")
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)


def test_model_scaling_logits_after_its_head_avoids_the_split_route():
    """Granite divides logits by `logits_scaling` in its forward: body + head alone would be
    wrong; its config field says so, and the head is applied inside the model's own forward."""
    model = tiny_llama(cls_name="Granite", logits_scaling=4.0)
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    packed = collate(batch, 0, "causal_lm", packing=True)
    assert losses.lm_parts(model) is None  # its config declares logits_scaling
    assert losses.choose_route(model, packed["input_ids"]) == "hook"
    expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
    got = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    assert_same(got, expected)
    with torch.no_grad():  # what body + head alone would have given
        hidden = model.get_decoder()(**losses.forward_inputs(packed, True))[0]
        keep = packed["labels"][:, 1:] != -100
        split = losses.cross_entropy_sum(
            model.get_output_embeddings(),
            losses.gather_rows(hidden, keep),
            packed["labels"][:, 1:][keep],
        )
    assert abs(split.item() - expected[0]) > 1e-2 * expected[0]


def test_undeclared_change_after_the_head_is_caught_by_the_logits_check():
    """A model whose forward changes the logits after its head without saying so in its config:
    body + head disagree with its own logits on the check, so its head runs inside its forward."""
    from transformers import LlamaForCausalLM

    class HalvedLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    donor = tiny_llama()
    model = HalvedLogits(donor.config)
    model.load_state_dict(donor.state_dict())
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    packed = collate(batch, 0, "causal_lm", packing=True)
    assert losses.lm_parts(model) is not None
    assert losses.choose_route(model, packed["input_ids"]) == "hook"
    expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
    got = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    assert_same(got, expected)


def test_model_that_ignores_packing_gets_padded_batches():
    """An attention that only knows "causal" (no block mask) would leak across packed examples;
    the packing check catches it, warns, and the batch is unpacked: the loss stays exact."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, q, k, v, attention_mask, **kw):
        # causal is enough for right-padded rows, not for packed ones
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kw)

    AttentionInterface.register("tunelab_test_causal_only", causal_only)
    model = tiny_llama(attn="tunelab_test_causal_only")
    model.config._attn_implementation = "tunelab_test_causal_only"
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    packed = collate(batch, 0, "causal_lm", packing=True)
    expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
    with pytest.warns(UserWarning, match="packed examples attend to each other"):
        assert not losses.packing_is_exact(model, packed["input_ids"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per model, not per batch
        got = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    assert_same(got, expected)


def test_unpack_restores_the_padded_batch():
    batch = examples()
    padded = collate(batch, 0, "causal_lm", packing=False)
    unpacked = losses.unpack(collate(batch, 0, "causal_lm", packing=True))
    assert torch.equal(unpacked["attention_mask"], padded["attention_mask"])
    keep = padded["attention_mask"].bool()
    assert torch.equal(unpacked["input_ids"][keep], padded["input_ids"][keep])
    assert torch.equal(unpacked["labels"][:, 1:], padded["labels"][:, 1:])


def train(model, packing: bool, steps: int = 3) -> list[float]:
    cfg = TrainingConfig(micro_batch_size=3, grad_accum_steps=2, max_steps=steps, lr=1e-2)
    data = examples(12, seed=3)
    source = StepSource(data, DataOrder(len(data), 0), 3, 2, 0, "causal_lm", packing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg)
    loop = Loop(
        model, optimizer, build_scheduler(optimizer, cfg, steps), source, cfg, steps, "causal_lm"
    )
    rows: list[dict] = []
    train_loop(loop, TrainState(), [lambda state, row: rows.append(row)])
    return [r["loss"] for r in rows]


def test_loop_packed_training_follows_the_padded_trajectory():
    """Packing is the default (training.packing: true) because it is exact: three AdamW steps
    of LoRA, packed, give the losses of the padded run."""
    assert TrainingConfig().packing is True
    padded = train(lora(tiny_llama()), packing=False)
    packed = train(lora(tiny_llama()), packing=True)
    assert len(set(padded)) == 3
    assert packed == pytest.approx(padded, rel=1e-5)


def test_packed_rows_use_per_example_attention():
    """A model on "sdpa" is switched to per-example attention for packed rows; it equals the
    block-diagonal mask it replaces and the examples run apart (GQA: 4 heads over 2 kv heads)."""
    from tunelab.stages.train.attention import PACKED_SDPA, Segments, segment_bounds

    model = tiny_llama()
    model.eval()
    batch = examples()
    packed = collate(batch, 0, "causal_lm", packing=True)
    ids, positions = packed["input_ids"], packed["position_ids"]
    with torch.no_grad():
        block_mask = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        apart = torch.cat(
            [model(input_ids=torch.tensor([e["input_ids"]])).logits for e in batch], dim=1
        )
        assert losses.packing_is_exact(model, ids)
        assert model.config._attn_implementation == PACKED_SDPA
        bounds = segment_bounds(positions)
        assert bounds == (0, *torch.tensor([len(e["input_ids"]) for e in batch]).cumsum(0).tolist())
        inputs = losses.forward_inputs(packed, losses.check_model(model, ids).packed_attention)
        assert inputs["tunelab_segments"] == bounds
        per_example = model(**inputs).logits
        # wrong boundaries change the result: the boundaries are what the attention uses
        wrong_bounds = Segments((0, bounds.bounds[2], bounds.bounds[-1]))
        wrong = model(**dict(inputs, tunelab_segments=wrong_bounds)).logits
    assert (per_example - block_mask).abs().max() < 1e-5
    assert (per_example - apart).abs().max() < 1e-5
    assert (wrong - per_example).abs().max() > 1e-2


def test_per_example_attention_leaves_padded_batches_and_generation_alone():
    model, reference = tiny_llama(), tiny_llama()
    model.eval(), reference.eval()
    packed = collate(examples(), 0, "causal_lm", packing=True)
    assert losses.packing_is_exact(model, packed["input_ids"])
    padded = collate(examples(), 0, "causal_lm", packing=False)
    with torch.no_grad():
        a = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        b = reference(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    assert torch.equal(a, b)
    prompt = torch.tensor([examples()[0]["input_ids"][:6]])
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kw), reference.generate(prompt, **kw))


def test_per_example_attention_under_activation_checkpointing():
    """Recomputed layers see the same example boundaries: same loss and gradients."""
    from tunelab.lib.models import enable_activation_checkpointing

    batch = examples()
    packed = collate(batch, 0, "causal_lm", packing=True)
    plain = lora(tiny_llama())
    expected = loss_and_grads(plain, lambda: losses.causal_lm_loss_sum(plain, packed))
    recomputed = lora(tiny_llama())
    enable_activation_checkpointing(recomputed)
    got = loss_and_grads(recomputed, lambda: losses.causal_lm_loss_sum(recomputed, packed))
    assert_same(got, expected)


# ------------------------------------------------------------------ attention routes

CPU = torch.device("cpu")
ROUTES_HERE = [r for r in attention.ROUTES if attention.unavailable(r, CPU, torch.float32) is None]
CUDA_ROUTES = ["flash_varlen", "torch_varlen", "flex", "per_example"]


def route_loss_and_grads(route, batch, precision="fp32", device=CPU):
    """(packed loss and grads by `route`, padded full-logits loss and grads) of a LoRA model."""
    model = lora(tiny_llama()).to(device)
    padded = to_device(collate(batch, 0, "causal_lm", packing=False), device)
    packed = to_device(collate(batch, 0, "causal_lm", packing=True), device)
    with autocast(precision, device):
        expected = loss_and_grads(model, lambda: reference_loss_sum(model, padded))
        if route == "block_mask":
            checks = losses.check_model(model, packed["input_ids"])
            attention.restore_sdpa(model.get_base_model())
        else:
            checks = losses.check_model(model, packed["input_ids"], route)
            assert checks.attention == route
        got = loss_and_grads(model, lambda: losses.causal_lm_loss_sum(model, packed))
    assert checks.packing_exact
    return got, expected


@pytest.mark.parametrize("route", [*ROUTES_HERE, "block_mask"])
def test_each_attention_route_here_gives_the_padded_loss_and_gradients(route):
    """Every route that runs on this machine, and transformers' block mask, trains exactly."""
    got, expected = route_loss_and_grads(route, examples(8, seed=2))
    assert_same(got, expected)


def test_auto_route_on_cpu_is_per_example_and_says_why_not_the_others():
    model = tiny_llama()
    checks = losses.check_model(model, collate(examples(), 0, "causal_lm", True)["input_ids"])
    record = checks.describe()
    assert record["attention"] == "per_example" and record["cross_entropy"] == "fused"
    reasons = {r["route"]: r["reason"] for r in record["attention_not_used"]}
    assert set(reasons) == {"flash_varlen", "torch_varlen", "flex"}
    assert "no backward on CPU" in reasons["flex"]


@pytest.mark.parametrize("route", ["flash_varlen", "torch_varlen", "flex"])
def test_a_route_asked_by_name_that_cannot_run_here_is_a_config_error(route):
    from tunelab.core.errors import ConfigError

    if attention.unavailable(route, CPU, torch.float32) is None:
        pytest.skip(f"{route} runs here")
    model = tiny_llama()
    with pytest.raises(ConfigError, match=f"training.attention: {route} cannot run here"):
        losses.check_model(model, torch.tensor([[5, 6, 7, 8]]), route)


def test_bf16_packing_check_passes_the_exact_route_and_catches_a_leak():
    """In bf16 the check allows the padded batch's own bf16 rounding, not a leak across
    examples: per-example attention passes, an attention that ignores packing does not."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got, expected = route_loss_and_grads("per_example", examples(8, seed=2), precision="bf16")
    assert_same(got, expected, tol=3e-2)

    def causal_only(module, q, k, v, attention_mask, **kw):
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kw)

    AttentionInterface.register("tunelab_test_causal_only_bf16", causal_only)
    leaky = tiny_llama(attn="tunelab_test_causal_only_bf16")
    leaky.config._attn_implementation = "tunelab_test_causal_only_bf16"
    ids = collate(examples(), 0, "causal_lm", True)["input_ids"]
    with autocast("bf16", CPU), pytest.warns(UserWarning, match="attend to each other"):
        assert not losses.check_model(leaky, ids).packing_exact


@pytest.mark.slow
@pytest.mark.skipif(attention.unavailable("flex", CPU, torch.float32) is None, reason="flex runs")
def test_flex_route_forward_on_cpu_equals_the_padded_logits():
    """FlexAttention has no CPU backward in this torch, but its compiled forward runs: the
    document mask, the layout and GQA of the flex route give the padded batch's logits."""
    model = tiny_llama().eval()
    batch = examples(8, seed=2)
    packed = collate(batch, 0, "causal_lm", packing=True)
    assert attention.use_route(model, "flex")
    with torch.no_grad():
        flex = model(**losses.forward_inputs(packed, True)).logits[0]
        apart = torch.cat(
            [model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in batch]
        )
    assert (flex - apart).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("route", CUDA_ROUTES)
def test_each_attention_route_on_cuda_gives_the_padded_loss_and_gradients(route, precision):
    cuda = torch.device("cuda")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    reason = attention.unavailable(route, cuda, dtype)
    if reason is not None:
        pytest.skip(reason)
    got, expected = route_loss_and_grads(route, examples(8, seed=2), precision, cuda)
    assert_same(got, expected, tol=3e-2 if precision == "bf16" else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_loss_on_cuda_equals_linear_then_cross_entropy():
    """Liger's kernel when installed, else tunelab's fused loss: the loss and gradients of
    F.linear + F.cross_entropy under bf16 autocast."""
    cuda = torch.device("cuda")
    head = torch.nn.Linear(64, 1000, bias=False).to(cuda)
    hidden = torch.randn(300, 64, device=cuda, requires_grad=True)
    targets = torch.randint(0, 1000, (300,), device=cuda)
    results = []
    for fused in (True, False):
        hidden.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                loss = losses.cross_entropy_sum(head, hidden, targets)
            else:
                loss = F.cross_entropy(head(hidden).float(), targets, reduction="sum")
        loss.backward()
        results.append((loss.item(), hidden.grad.clone()))
    (a, ga), (b, gb) = results
    assert a == pytest.approx(b, rel=2e-2)
    assert (ga - gb).abs().max() <= 3e-2 * (1 + gb.abs().max())
