"""Linear layers packed for oneDNN (the evaluation copy on a CPU): the same outputs as the dense
layers to float rounding, the same greedy tokens, and a stated reason where packing does not
apply."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_packed_layers_compute_what_the_dense_ones_do(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from tunelab.lib.inference.packed_linear import PackedLinear, pack_linears, packing_unavailable

    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert packing_unavailable(packed) is None
    n = len(linears(packed))
    assert n > 0 and pack_linears(packed, rows=2) == n
    assert not linears(packed)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n
    gen = torch.Generator().manual_seed(0)
    # prefill widths and single decoding rows: the layout hint (2 rows) does not limit the shape
    for shape in [(2, 9), (3, 1), (1, 17)]:
        ids = torch.randint(3, 500, shape, generator=gen)
        with torch.inference_mode():
            want, got = dense(input_ids=ids).logits, packed(input_ids=ids).logits
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    ids = torch.randint(3, 500, (2, 6), generator=gen)
    with torch.inference_mode():
        greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(packed.generate(ids, **greedy), dense.generate(ids, **greedy))


def test_packing_states_why_it_does_not_apply(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from tunelab.lib.inference.packed_linear import packing_unavailable

    half = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    assert packing_unavailable(half) == "linear weights in bfloat16, packed only in float32"
    assert packing_unavailable(torch.nn.Sequential(torch.nn.ReLU())) == (
        "the model has no linear layer"
    )


def test_a_weight_onednn_refuses_leaves_the_model_dense_and_the_evaluation_uncopied():
    """A layer with no inputs cannot be packed: no layer is replaced, and the evaluation runs on
    the model as loaded with oneDNN's reason in the record."""
    from tunelab.lib.inference.eval_copy import EvalModels
    from tunelab.lib.inference.packed_linear import pack_linears

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(0, 4))
    with pytest.raises(RuntimeError):
        pack_linears(model, rows=2)
    assert len(linears(model)) == 2
    models = EvalModels.prepare(model, None, 2e-4, 2)
    assert models.current is model and models.record["copy"] is False
    assert models.record["packed"]["reason"].startswith("oneDNN refused to pack a weight: ")
