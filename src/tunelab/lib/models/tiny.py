"""Tiny real models and tokenizers built in-process, for tests and benchmarks.

They are genuine transformers models (Llama, BERT) with a trained byte-level BPE / WordPiece
tokenizer, only small: every code path that runs on SmolLM2 or MiniLM runs on them in seconds.

`save_tiny_llama(dir)`, `save_tiny_bert(dir)`, `save_tiny_vit(dir)`; the family matrix's models
(one table row per family) are built by `tunelab.lib.models.tiny_families`. Tests use them through the
session fixtures `tiny_llama_dir`, `tiny_bert_dir`, `tiny_vit_dir` of tests/conftest.py (beside
`minilm_dir`, `smollm2_dir`, `bbc_dir`, `spam_dir`; `tests/helpers.py` has `run_cli(capsys,
*args)`, `tree_hashes`, `fill_hypothesis`).
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Markets rallied as the central bank held interest rates steady.",
    "The striker scored twice in the second half to win the match.",
    "A new smartphone with a faster chip and longer battery life was announced.",
    "The film won the award for best picture at the festival.",
    "Parliament voted on the new budget after a long debate.",
    '{"sender": "alice@example.com", "subject": "Meeting tomorrow", "date": "2002-08-22"}',
    "From: bob@example.org Subject: Re: your account Date: Thu, 22 Aug 2002 12:00:00 +0000",
    "Extract the fields as a JSON object. Classify the text into one of the categories.",
    "business entertainment politics sport tech spam ham yes no true false null 0123456789",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ {}[]:;,.!?@#-_'\"/\\<>=+*&%$()",
]


def train_tiny_tokenizer(model: str, specials: list[str], vocab_size: int = 512):
    """A `tokenizers.Tokenizer` trained on the tiny corpus: "bpe" (byte level, as SmolLM2's and
    Llama 3's) or "wordpiece" (lower-cased, as BERT's), `specials` first in the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if model == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False
        )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return tok


def build_tiny_causal_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML specials, like SmolLM2's (pad = eos = <|im_end|>)."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = train_tiny_tokenizer("bpe", specials, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_encoder_tokenizer(vocab_size: int = 512):
    """A WordPiece tokenizer with [CLS] ... [SEP] like MiniLM's."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_tiny_tokenizer(
        "wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], vocab_size
    )
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def save_tiny_llama(
    out: Path, *, hidden: int = 32, layers: int = 2, heads: int = 4, seed: int = 0
) -> Path:
    """A 2-layer Llama (hidden 32) with the tiny ChatML tokenizer, saved as a transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_causal_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return _save_seeded(LlamaForCausalLM, cfg, tok, out, seed)


def save_tiny_bert(
    out: Path, *, hidden: int = 32, layers: int = 2, heads: int = 4, seed: int = 0
) -> Path:
    """A 2-layer BERT encoder (hidden 32) with the tiny WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    tok = build_tiny_encoder_tokenizer()
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = BertModel(cfg)
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def save_tiny_vit(
    out: Path,
    *,
    image_size: int = 16,
    patch_size: int = 4,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
) -> Path:
    """A 2-layer ViT backbone (hidden 32, 16x16 images, 4x4 patches) with its image processor."""
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    cfg = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2,
    )
    torch.manual_seed(seed)
    model = ViTModel(cfg, add_pooling_layer=False)
    out = Path(out)
    model.save_pretrained(out)
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(out)
    return out


def save_tiny_moe(
    out: Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    experts: int = 8,
    top_k: int = 2,
    expert_intermediate: int = 16,
    seed: int = 0,
) -> Path:
    """A Qwen3-MoE (every block routed to `top_k` of `experts` fused experts) with the tiny
    ChatML tokenizer, saved as a transformers folder."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tiny_causal_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=expert_intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden // heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    return _save_seeded(Qwen3MoeForCausalLM, cfg, tok, out, seed)


def _save_seeded(model_class: type, cfg: object, tok: object, out: str | Path, seed: int) -> Path:
    """Build `model_class(cfg)` under `seed` and save it with its tokenizer in `out`."""
    import torch

    torch.manual_seed(seed)
    model = model_class(cfg)
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
