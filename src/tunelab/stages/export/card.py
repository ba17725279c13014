"""The model card: the README.md of an export, written from its manifest alone (read as
`ExportManifest`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tunelab.core.record_export import ExportGuardrails, ExportResults, ProcessorGap
from tunelab.core.record_parts import Primary
from tunelab.core.record_types import ExportManifest
from tunelab.stages.export.limitations import number_text
from tunelab.stages.export.manifest import MANIFEST, as_manifest

TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _prompt_lines(m: ExportManifest) -> list[str]:
    """What a user of the model must send and may expect back: the instruction a causal LM's
    prompts began with, and for a format task the format every answer was held to."""
    # the study config's task section as saved (core.config validated it when the run started)
    task = (m.config or {}).get("task") or {}
    out = []
    if task.get("instruction") and m.bound_base.architecture == "causal_lm":
        out.append(f"- Instruction before each input: {json.dumps(task['instruction'])}")
    if task.get("kind") == "format" and task.get("regex") is not None:
        out.append(f"- Answer format: the whole answer matches the regex `{task['regex']}`")
    elif task.get("kind") == "format" and task.get("json_schema") is not None:
        schema = json.dumps(task["json_schema"], sort_keys=True)
        out.append(f"- Answer format: one JSON value satisfying the schema `{schema}`")
    return out


def _applied_adaptation(adaptation: Any) -> Any:
    """The adaptation settings as the card states them: the 4-bit settings only for QLoRA
    (every config carries their defaults, which a LoRA or full run never used)."""
    if not isinstance(adaptation, dict) or adaptation.get("method") == "qlora":
        return adaptation
    return {k: v for k, v in adaptation.items() if k != "quantization"}


def model_card(m: ExportManifest | Mapping[str, Any]) -> str:
    """README.md of an export, from its manifest."""
    m = as_manifest(m)
    base, art, task, hyp = m.bound_base, m.contents, m.task, m.tested
    lines = [
        f"# {m.study}: {art.method} fine-tune of {base.name}",
        "",
        f"Exported by tunelab {m.tunelab_version} from run `{m.run_id}` "
        f"({m.created_at}). Manifest: `{MANIFEST}`.",
        "",
        "## What it is for",
        "",
        f"- Task: {task.kind}"
        + (f", labels {', '.join(task.labels)}" if task.labels else "")
        + (f", fields {', '.join(task.fields)}" if task.fields else ""),
        *_prompt_lines(m),
        f"- Hypothesis v{hyp.version}: {hyp.behaviour}",
        f"- Primary metric: {hyp.primary_metric} (must improve by at least {hyp.min_improvement})",
        "",
        "## Base model (verified by hash before loading)",
        "",
        f"- Name: {base.name}, revision {base.revision or '-'}",
        *([f"- Hub: `{hub.repo_id}` at commit `{hub.commit}`"] if (hub := base.hub) else []),
        f"- Architecture: {base.architecture}",
        f"- Identity sha256: `{base.sha256}`",
        "",
        "| file | sha256 |",
        "|---|---|",
        *[f"| {n} | `{h}` |" for n, h in sorted((base.files or {}).items())],
        "",
        "## Results on the validation split",
        "",
    ]
    lines += _results_lines(m.comparison)
    lines += ["", "## Guardrails", ""]
    lines += _guardrail_lines(m.guardrail_check)
    lines += ["", "## Limitations", ""]
    lines += [f"- {line}" for line in m.limitations or []] or ["- none recorded"]
    lines += _loading_lines(m)
    env = m.environment.training
    if env is not None and env.raw:
        lines.append(
            f"- Environment: torch {env.torch}, backend {env.backend}, "
            f"devices {', '.join(env.gpus or []) or env.cpu}"
        )
    return "\n".join(lines) + "\n"


def _results_lines(res: ExportResults | None) -> list[str]:
    """The results against the baseline: each metric with its paired interval."""
    lines: list[str] = []
    if res is None or not res.raw:
        lines.append("Not compared with a baseline (see limitations).")
    else:
        lines += [
            f"Against baseline `{res.baseline.run_id}`, {res.n_paired} paired "
            f"examples, 95% paired bootstrap intervals.",
            "",
            "| metric | baseline | this model | delta | 95% CI |",
            "|---|---|---|---|---|",
        ]
        for name, v in res.metrics.items():
            ci = (
                f"[{number_text(v.ci_low)}, {number_text(v.ci_high)}]"
                if v.ci_low is not None
                else "-"
            )
            lines.append(
                f"| {name} | {number_text(v.baseline)} | {number_text(v.variant)} | "
                f"{number_text(v.delta)} | {ci} |"
            )
        lines += ["", primary_verdict(res.primary)]
    return lines


def _guardrail_lines(g: ExportGuardrails | None) -> list[str]:
    lines: list[str] = []
    if g is None or not g.verdicts:
        lines.append("Not checked.")
    else:
        lines.append(f"All pass: {g.passed}.")
        lines.append("")
        lines += ["| rule | item | value | bound | pass |", "|---|---|---|---|---|"]
        for v in g.verdicts:
            lines.append(
                f"| {v.rule} | {v.item if v.item is not None else '-'} | "
                f"{number_text(v.value)} | {number_text(v.bound)} | {v.passed} |"
            )
    return lines


def _loading_lines(m: ExportManifest) -> list[str]:
    """How to check the base and load the export (transformers, peft), then how it was trained."""
    base, task = m.bound_base, m.task
    arch = base.architecture
    auto = {
        "encoder": "AutoModelForSequenceClassification",
        "image": "AutoModelForImageClassification",
    }.get(arch, "AutoModelForCausalLM")
    reader = "AutoImageProcessor" if arch == "image" else "AutoTokenizer"
    labelled = arch in ("encoder", "image") and task.labels
    head = f", num_labels={len(task.labels)}" if labelled else ""
    lines = [
        "",
        "## Loading",
        "",
        "Check the base first (refuses a base whose files differ by one byte):",
        "",
        "```",
        "tunelab check-export THIS_FOLDER --base /path/to/base",
        "```",
        "",
        "```python",
        f"from transformers import {reader}, {auto}",
    ]
    lines += _load_lines(m, auto, head)
    lines.append(f'tokenizer = {reader}.from_pretrained("THIS_FOLDER/tokenizer")')
    lines += _processor_lines(m.detail.processor)
    lines += [
        "```",
        "",
        "## Training",
        "",
        f"- Adaptation: {json.dumps(_applied_adaptation(m.adaptation), sort_keys=True)}",
        f"- Training: {json.dumps(m.training, sort_keys=True)}",
        f"- Data snapshot: `{m.data_snapshot}`",
        f"- Config sha256: `{m.config_sha256}`",
    ]
    return lines


def _load_lines(m: ExportManifest, auto: str, head: str) -> list[str]:
    """The Python lines that load the export: the adapter (QLoRA: onto the base in 4 bits with
    the recorded settings) or the whole model, both from the folder itself."""
    art = m.contents
    if art.kind != "adapter":
        if not art.merged:
            return ["", f'model = {auto}.from_pretrained("THIS_FOLDER")']
        dtype = TORCH_DTYPES[art.dtype]
        return ["import torch", "", f'model = {auto}.from_pretrained("THIS_FOLDER", dtype={dtype})']
    lines = ["from peft import PeftModel", ""]
    q = m.bound_base.quantization
    if art.method == "qlora" and q is not None and q.raw:
        compute = TORCH_DTYPES[q.compute_dtype]
        lines = [
            "import torch",
            "from transformers import BitsAndBytesConfig",
            *lines,
            "bnb = BitsAndBytesConfig(",
            f'    load_in_4bit=True, bnb_4bit_quant_type="{q.quant_type}",',
            f"    bnb_4bit_use_double_quant={q.double_quant}, bnb_4bit_compute_dtype={compute},",
            ")",
        ]
        head += ", quantization_config=bnb"
    return lines + [
        f'base = {auto}.from_pretrained("/path/to/base"{head})',
        'model = PeftModel.from_pretrained(base, "THIS_FOLDER")',
    ]


def primary_verdict(primary: Primary | Mapping[str, Any]) -> str:
    """The primary metric's two verdicts side by side: its interval's and its threshold's."""
    from tunelab.stages.compare.stage import interval_verdict

    if not isinstance(primary, Primary):
        primary = Primary.of(MANIFEST, primary, "results.primary")
    meets = primary.meets_min_improvement
    threshold = "-" if meets is None else ("met" if meets else "not met")
    return (
        f"Primary metric {primary.metric}: delta {number_text(primary.delta)}, "
        f"95% interval {interval_verdict(primary.raw)} (significant: "
        f"{'yes' if primary.significant else 'no'}); minimum improvement "
        f"{number_text(primary.min_improvement)}: {threshold}."
    )


def _processor_lines(processor: ProcessorGap | None) -> list[str]:
    """What the exported image processor gives, as a comment under the loading lines."""
    if processor is None or not processor.raw:
        return []
    if processor.matches:
        return [
            "# its pixel_values are the training transforms' (RGB conversion on, transparency "
            "on white), checked at export"
        ]
    return ["# NOT the training transforms: see Limitations"]
