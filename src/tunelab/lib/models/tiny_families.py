"""Tiny random models of the families renters fine-tune, one table row each.

`FAMILIES` holds a `Family` per model type: its config and model classes, the config settings
that make the family what it is (sliding windows, softcapping, experts, multipliers) and its
tokenizer convention (`TOKEN_STYLES`: special tokens, BOS/EOS/pad, the chat template written in
the family's style, the EOS ids of generation_config). `save_family(name, dir)` builds one with
hidden size 32 and 2 layers, its vocabulary padded past the tokenizer (as Qwen's and Gemma's
checkpoints are), and saves a real checkpoint folder (weights, config, generation_config,
tokenizer or image processor). `buildable(name)` says why this transformers cannot build one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunelab.lib.models.tiny import CHATML_TEMPLATE, train_tiny_tokenizer

HIDDEN, LAYERS, HEADS = 32, 2, 4
VOCAB_MULTIPLE = 64  # the embedding rows past the tokenizer's last id, as checkpoints pad them


@dataclass(frozen=True)
class TokenStyle:
    """A family's tokenizer convention: which specials exist and what they are for."""

    model: str  # "bpe" (byte level) or "wordpiece"
    specials: tuple[str, ...]
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None  # None: the family ships no pad token
    unk: str | None = None
    cls: str | None = None
    sep: str | None = None
    mask: str | None = None
    generation_eos: tuple[str, ...] = ()  # generation_config.eos_token_id, in this order
    template: str | None = None


def _template(turn: str, prompt: str, system: bool = True) -> str:
    """A chat template whose every turn is `turn` (jinja reading `role` and `content`) and whose
    generation prompt is `prompt`; `system=False` refuses a system role, as Gemma's does."""
    refuse = (
        "{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        if not system
        else ""
    )
    return (
        "{% for message in messages %}" + refuse + "{% set role = message['role'] %}"
        "{% set content = message['content'] %}" + turn + "{% endfor %}"
        "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    )


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_STYLES: dict[str, TokenStyle] = {
    "chatml": TokenStyle(
        "bpe",
        _CHATML,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        template=CHATML_TEMPLATE,
    ),
    # Qwen3: an empty reasoning block opens the last assistant turn
    "qwen3": TokenStyle(
        "bpe",
        (*_CHATML, "<think>", "</think>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        template=_template(
            "{% if role == 'assistant' %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'"
            " + content + '<|im_end|>\\n' }}{% else %}"
            "{{ '<|im_start|>' + role + '\\n' + content + '<|im_end|>\\n' }}{% endif %}",
            "{{ '<|im_start|>assistant\\n' }}",
        ),
    ),
    "llama3": TokenStyle(
        "bpe",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
        + ("<|eot_id|>",),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        generation_eos=("<|end_of_text|>", "<|eot_id|>"),
        template="{{ bos_token }}"
        + _template(
            "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + content + "
            "'<|eot_id|>' }}",
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}",
        ),
    ),
    # Mistral / Mixtral Instruct: the user turn ends with the cue, no generation prompt
    "inst": TokenStyle(
        "bpe",
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        generation_eos=("</s>",),
        template="{{ bos_token }}"
        + _template(
            "{% if role == 'user' %}{{ '[INST] ' + content + ' [/INST]' }}"
            "{% elif role == 'assistant' %}{{ content + eos_token }}"
            "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
            "{% endif %}",
            "",
        ),
    ),
    "gemma": TokenStyle(
        "bpe",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>",
        eos="<end_of_turn>",
        pad="<pad>",
        unk="<unk>",
        generation_eos=("<eos>", "<end_of_turn>"),
        template="{{ bos_token }}"
        + _template(
            "{% set role = 'model' if role == 'assistant' else role %}"
            "{{ '<start_of_turn>' + role + '\\n' + content + '<end_of_turn>\\n' }}",
            "{{ '<start_of_turn>model\\n' }}",
            system=False,
        ),
    ),
    "phi3": TokenStyle(
        "bpe",
        ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        eos="<|end|>",
        pad="<|endoftext|>",
        unk="<unk>",
        generation_eos=("<|endoftext|>", "<|end|>"),
        template=_template(
            "{{ '<|' + role + '|>\\n' + content + '<|end|>\\n' }}", "{{ '<|assistant|>\\n' }}"
        ),
    ),
    # OLMo 2 (Tulu): BOS = EOS = <|endoftext|>, its own pad
    "tulu": TokenStyle(
        "bpe",
        ("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"),
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        pad="<|pad|>",
        generation_eos=("<|endoftext|>",),
        template=_template(
            "{% if role == 'assistant' %}{{ '<|assistant|>\\n' + content + eos_token + '\\n' }}"
            "{% else %}{{ '<|' + role + '|>\\n' + content + '\\n' }}{% endif %}",
            "{{ '<|assistant|>\\n' }}",
        ),
    ),
    "granite": TokenStyle(
        "bpe",
        ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
        bos="<|end_of_text|>",
        eos="<|end_of_text|>",
        pad="<|end_of_text|>",
        generation_eos=("<|end_of_text|>",),
        template=_template(
            "{{ '<|start_of_role|>' + role + '<|end_of_role|>' + content + '<|end_of_text|>\\n' }}",
            "{{ '<|start_of_role|>assistant<|end_of_role|>' }}",
        ),
    ),
    # gpt-oss (harmony): the answer is the final channel, ended by <|return|>
    "harmony": TokenStyle(
        "bpe",
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>")
        + ("<|return|>", "<|channel|>", "<|call|>"),
        eos="<|return|>",
        pad="<|endoftext|>",
        generation_eos=("<|return|>", "<|call|>"),
        template=_template(
            "{% if role == 'assistant' %}"
            "{{ '<|start|>assistant<|channel|>final<|message|>' + content + '<|return|>' }}"
            "{% else %}{{ '<|start|>' + role + '<|message|>' + content + '<|end|>' }}{% endif %}",
            "{{ '<|start|>assistant<|channel|>final<|message|>' }}",
        ),
    ),
    "wordpiece": TokenStyle(
        "wordpiece",
        ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
        pad="[PAD]",
        unk="[UNK]",
        cls="[CLS]",
        sep="[SEP]",
        mask="[MASK]",
    ),
    "roberta": TokenStyle(
        "bpe",
        ("<s>", "<pad>", "</s>", "<unk>", "<mask>"),
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        cls="<s>",
        sep="</s>",
        mask="<mask>",
    ),
    "modernbert": TokenStyle(
        "bpe",
        ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "<|padding|>"),
        pad="[PAD]",
        unk="[UNK]",
        cls="[CLS]",
        sep="[SEP]",
        mask="[MASK]",
    ),
}


@dataclass(frozen=True)
class Family:
    """One row of the matrix: a model type, what is special about it, how it is built."""

    name: str
    kind: str  # "decoder", "encoder" or "image"
    config_class: str
    model_class: str
    special: str  # what is special about the family (docs/models.md)
    settings: dict[str, Any] = field(default_factory=dict)
    style: str | None = None  # TOKEN_STYLES key (text families)
    processor: tuple[str, dict[str, Any]] | None = None  # image families: class and settings


_HEAD8 = {"head_dim": HIDDEN // HEADS}
_SLIDING = {"sliding_window": 8}  # short enough that the matrix's sequences cross it
_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
_BASE_IMAGE = {"image_size": 32, "num_channels": 3}
_VIT_LIKE = {
    **_BASE_IMAGE,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": HIDDEN * 2,
    "patch_size": 8,
}

FAMILIES: tuple[Family, ...] = (
    Family("llama", "decoder", "LlamaConfig", "LlamaForCausalLM", "Llama 3 header turns, no pad token, BOS in the template", style="llama3"),
    Family("qwen2", "decoder", "Qwen2Config", "Qwen2ForCausalLM", "q/k/v biases, ChatML", style="chatml"),
    Family("qwen3", "decoder", "Qwen3Config", "Qwen3ForCausalLM", "q/k norms per head, an empty <think> block opens the answer turn", _HEAD8, "qwen3"),
    Family("qwen3_moe", "decoder", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "routed fused experts (4, top 2)", {**_HEAD8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}, "qwen3"),
    Family("mistral", "decoder", "MistralConfig", "MistralForCausalLM", "sliding-window attention, [INST] template without a generation prompt, no pad", _SLIDING, "inst"),
    Family("mixtral", "decoder", "MixtralConfig", "MixtralForCausalLM", "sparse experts (num_local_experts), [INST] template", _EXPERTS, "inst"),
    Family("gemma2", "decoder", "Gemma2Config", "Gemma2ForCausalLM", "sliding and global layers alternate, attention and final logit softcapping, no system role", {**_HEAD8, **_SLIDING, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 8}, "gemma"),
    Family("gemma3_text", "decoder", "Gemma3TextConfig", "Gemma3ForCausalLM", "sliding layers with their own RoPE base, q/k norms, no system role", {**_HEAD8, **_SLIDING, "query_pre_attn_scalar": 8, "layer_types": ["sliding_attention", "full_attention"]}, "gemma"),
    Family("phi3", "decoder", "Phi3Config", "Phi3ForCausalLM", "fused qkv_proj and gate_up_proj, <|end|> ends a turn", {}, "phi3"),
    Family("olmo2", "decoder", "Olmo2Config", "Olmo2ForCausalLM", "norms after attention and MLP, BOS = EOS", {}, "tulu"),
    Family("granite", "decoder", "GraniteConfig", "GraniteForCausalLM", "embedding, residual, attention and logit multipliers", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0}, "granite"),
    Family("smollm3", "decoder", "SmolLM3Config", "SmolLM3ForCausalLM", "every fourth layer without RoPE (NoPE), ChatML", {"no_rope_layer_interval": 2}, "chatml"),
    Family("gpt_oss", "decoder", "GptOssConfig", "GptOssForCausalLM", "experts with biases, attention sinks, sliding and full layers alternate, harmony format", {**_HEAD8, **_EXPERTS, **_SLIDING, "layer_types": ["sliding_attention", "full_attention"]}, "harmony"),
    Family("bert", "encoder", "BertConfig", "BertModel", "WordPiece, [CLS] pooled by a pooler", style="wordpiece"),
    Family("roberta", "encoder", "RobertaConfig", "RobertaModel", "byte-level BPE, <s> </s>, position ids offset by the pad id", {"max_position_embeddings": 258}, "roberta"),
    Family("deberta-v2", "encoder", "DebertaV2Config", "DebertaV2Model", "disentangled relative attention, no absolute positions", {"relative_attention": True, "position_buckets": 16, "pos_att_type": ["p2c", "c2p"], "position_biased_input": False}, "wordpiece"),
    Family("distilbert", "encoder", "DistilBertConfig", "DistilBertModel", "its own config names (dim, n_layers), no token types", {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "hidden_dim": HIDDEN * 2}, "wordpiece"),
    Family("modernbert", "encoder", "ModernBertConfig", "ModernBertModel", "RoPE, alternating local (sliding) and global attention, no biases", {"local_attention": 8, "global_attn_every_n_layers": 2}, "modernbert"),
    Family("electra", "encoder", "ElectraConfig", "ElectraModel", "embedding size apart from the hidden size", {"embedding_size": 16}, "wordpiece"),
    Family("vit", "image", "ViTConfig", "ViTModel", "fixed input size (no interpolation unless asked)", _VIT_LIKE, processor=("ViTImageProcessor", {"size": {"height": 32, "width": 32}})),
    Family("deit", "image", "DeiTConfig", "DeiTModel", "a distillation token beside CLS; resize then center crop", _VIT_LIKE, processor=("DeiTImageProcessor", {"size": {"height": 36, "width": 36}, "crop_size": {"height": 32, "width": 32}})),
    Family("convnext", "image", "ConvNextConfig", "ConvNextModel", "convolutional, no patches tokens; shortest-edge resize with crop_pct", {"image_size": 32, "hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}, processor=("ConvNextImageProcessor", {"size": {"shortest_edge": 32}, "crop_pct": 0.875})),
    Family("swin", "image", "SwinConfig", "SwinModel", "depths and heads per stage (lists), shifted windows", {**_BASE_IMAGE, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4], "window_size": 4}, processor=("ViTImageProcessor", {"size": {"height": 32, "width": 32}})),
    Family("dinov2", "image", "Dinov2Config", "Dinov2Model", "interpolated position embeddings (any input size), a mask token the classifier never uses", _VIT_LIKE, processor=("BitImageProcessor", {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}})),
)  # fmt: skip
BY_NAME = {f.name: f for f in FAMILIES}


def buildable(name: str) -> str | None:
    """None when this transformers has the family's classes, else why it cannot build it."""
    import transformers

    family = BY_NAME[name]
    missing = [c for c in (family.config_class, family.model_class) if not hasattr(transformers, c)]
    if missing:
        return f"transformers {transformers.__version__} has no {', '.join(missing)}"
    return None


def build_tokenizer(style: TokenStyle):
    """A tokenizer trained on the tiny corpus with `style`'s specials and roles."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_tiny_tokenizer(style.model, list(style.specials))
    if style.cls and style.sep:  # encoders: [CLS] text [SEP]
        cls_id, sep_id = tok.token_to_id(style.cls), tok.token_to_id(style.sep)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{style.cls} $A {style.sep}",
            pair=f"{style.cls} $A {style.sep} $B:1 {style.sep}:1",
            special_tokens=[(style.cls, cls_id), (style.sep, sep_id)],
        )
    roles = ("bos", "eos", "pad", "unk", "cls", "sep", "mask")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **{f"{r}_token": getattr(style, r) for r in roles if getattr(style, r)},
    )
    others = [s for s in style.specials if s not in {getattr(style, r) for r in roles}]
    fast.add_special_tokens({"additional_special_tokens": others})
    if style.template:
        fast.chat_template = style.template
    return fast


def _text_config(family: Family, tok: Any, style: TokenStyle) -> dict[str, Any]:
    size = -(-(len(tok) + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    out = {
        "vocab_size": size,
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN * 2,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "max_position_embeddings": 256,
        "pad_token_id": tok.pad_token_id,
    }
    if family.kind == "decoder":
        out.update(
            num_key_value_heads=HEADS // 2,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.convert_tokens_to_ids(t) for t in style.generation_eos],
        )
    else:  # ModernBERT's config names its own (50k-vocabulary) ids unless told
        ids = {"cls_token_id": tok.cls_token_id, "sep_token_id": tok.sep_token_id}
        out.update(ids, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    return out


def save_family(name: str, out: Path, seed: int = 0) -> Path:
    """Build family `name` (a row of FAMILIES) at random and save it as a checkpoint folder."""
    import torch
    import transformers

    family = BY_NAME[name]
    reason = buildable(name)
    if reason:
        raise RuntimeError(reason)
    out = Path(out)
    if family.kind == "image":
        settings = dict(family.settings)
        proc_class, proc_settings = family.processor
        getattr(transformers, proc_class)(**proc_settings).save_pretrained(out)
    else:
        style = TOKEN_STYLES[family.style]
        tok = build_tokenizer(style)
        settings = {**_text_config(family, tok, style), **family.settings}
        tok.save_pretrained(out)
    config = getattr(transformers, family.config_class)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    model.save_pretrained(out)
    if family.kind == "decoder":
        transformers.GenerationConfig(
            bos_token_id=tok.bos_token_id,
            eos_token_id=settings["eos_token_id"],
            pad_token_id=tok.pad_token_id,
        ).save_pretrained(out)
    return out
