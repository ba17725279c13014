"""A tiny Llama, its LoRA and example rows for exactness tests of the training paths."""

from __future__ import annotations

import random

import torch

VOCAB = 300


def tiny_llama(seed: int = 0, attn: str = "sdpa", cls_name: str = "Llama", **extra):
    import transformers

    config_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config)
    # random weights give logits near 0; scale the head so logits and differences are large
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    # B starts at zero; move it so the adapters change the outputs and get gradients everywhere
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def examples(n: int = 6, seed: int = 0) -> list[dict]:
    """Unequal lengths, unequal prompts (labels -100 on the prompt), one without any loss."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(4, 40)
        prompt = length if i == 2 else rng.randint(1, length - 2)
        ids = [rng.randrange(3, VOCAB) for _ in range(length)]
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    assert len({len(e["input_ids"]) for e in out}) > 3
    return out
