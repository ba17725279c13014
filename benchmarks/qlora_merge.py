"""`tunelab export --merge` of a QLoRA adapter against peft's own merge on the 4-bit model.

    python benchmarks/qlora_merge.py                    # tunelab.lib.models.tiny's Llama, hidden 256
    python benchmarks/qlora_merge.py --model smollm2    # SmolLM2-135M (the packaged GGUF)

The base is loaded in 4 bits as tunelab trains QLoRA (NF4, double quantization, bf16 compute,
CPU), LoRA r=8 on every linear layer is trained `--steps` AdamW steps on real text (this
repository's docs/*.md in 128-token rows) so that the adapter is not zero, then the adapted
model (4-bit base + adapter) is compared on 8 held-out rows with:

- tunelab's merge (`tunelab.stages.export.merge.merge_adapter`: dequantize, merge, in bf16 and in fp32;
  saved and loaded back with plain transformers, as the export is);
- the peer: peft's `merge_and_unload()` on the 4-bit model, which quantizes the merged weights
  to 4 bits again.

Each line gives the largest absolute logit difference from the adapted model and the share of
positions whose greedy token agrees; the last line reads
`peer_over_tunelab_max_diff=R tunelab_bf16_max_diff=D tunelab_bf16_greedy=G`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from tunelab.stages.export.merge import load_merged, logit_agreement, merge_adapter

ROWS, SEQ = 8, 128


def base_folder(name: str, work: Path) -> Path:
    if name == "tiny":
        from tunelab.lib.models.tiny import save_tiny_llama

        folder = work / "tiny-llama-h256"
        if not folder.exists():
            save_tiny_llama(folder, hidden=256, layers=4, heads=4)
        return folder
    from tunelab.core.assets import smollm2_gguf
    from tunelab.lib.models.gguf import convert_gguf

    return convert_gguf(*smollm2_gguf())


def load_4bit(folder: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tunelab.lib.models.quantize import keep_weights_as_loaded

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb)
    keep_weights_as_loaded(model)
    return model


def text_rows(tokenizer, count: int) -> torch.Tensor:
    """[count, SEQ] token ids of this repository's documentation."""
    docs = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    ids = tokenizer("\n\n".join(p.read_text() for p in docs))["input_ids"]
    if len(ids) < count * SEQ:
        raise SystemExit(f"only {len(ids)} tokens of docs; need {count * SEQ}")
    return torch.tensor(ids[: count * SEQ]).view(count, SEQ) % tokenizer.vocab_size


def train_adapter(folder: Path, rows: torch.Tensor, steps: int, out: Path):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    torch.manual_seed(0)
    model = prepare_model_for_kbit_training(load_4bit(folder), use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for step in range(steps):
        batch = rows[(step * 4) % len(rows) :][:4]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peft import PeftModel
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="tunelab-qlora-merge-"))
    folder = base_folder(args.model, Path(tempfile.gettempdir()))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = text_rows(tokenizer, 16 + ROWS)
    train_adapter(folder, rows[:16], args.steps, work / "adapter")
    held_out = rows[16:]
    mask = torch.ones_like(held_out)
    adapted = PeftModel.from_pretrained(load_4bit(folder), work / "adapter").eval()
    results = {}
    for dtype in ("bf16", "fp32"):
        merge_adapter(load_4bit(folder), work / "adapter", dtype).save_pretrained(work / dtype)
        merged = load_merged(work / dtype, "causal_lm", dtype)
        results[f"tunelab {dtype}"] = logit_agreement(adapted, merged, held_out, mask, causal=True)
    peer = PeftModel.from_pretrained(load_4bit(folder), work / "adapter").merge_and_unload()
    results["peft 4-bit merge"] = logit_agreement(adapted, peer.eval(), held_out, mask, causal=True)
    print(f"\n{args.model}: {ROWS} held-out rows x {SEQ} tokens, logits up to "
          f"{results['tunelab bf16']['logits_max_abs']:.1f} in absolute value")  # fmt: skip
    print(f"{'merge':18} {'max |logit diff|':>16} {'greedy agreement':>17}")
    for name, r in results.items():
        print(f"{name:18} {r['logits_max_abs_diff']:>16.4f} {r['greedy_agreement']:>16.2%}")
    ours = results["tunelab bf16"]
    ratio = results["peft 4-bit merge"]["logits_max_abs_diff"] / ours["logits_max_abs_diff"]
    print(
        f"peer_over_tunelab_max_diff={ratio:.1f} tunelab_bf16_max_diff="
        f"{ours['logits_max_abs_diff']:.4f} tunelab_bf16_greedy={ours['greedy_agreement']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
