"""The model card: the README.md of an export, written from its manifest alone."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tunelab.stages.export.limitations import number_text
from tunelab.stages.export.manifest import MANIFEST

TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _prompt_lines(m: Mapping[str, Any]) -> list[str]:
    """What a user of the model must send and may expect back: the instruction a causal LM's
    prompts began with, and for a format task the format every answer was held to."""
    task = (m.get("config") or {}).get("task") or {}
    out = []
    if task.get("instruction") and m["base"].get("architecture") == "causal_lm":
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


def model_card(m: Mapping[str, Any]) -> str:
    """README.md of an export, from its manifest."""
    base = m["base"]
    art = m["artifact"]
    task = m["task"]
    hyp = m.get("hypothesis") or {}
    lines = [
        f"# {m['study']}: {art['method']} fine-tune of {base.get('name')}",
        "",
        f"Exported by tunelab {m['tunelab_version']} from run `{m['run_id']}` "
        f"({m['created_at']}). Manifest: `{MANIFEST}`.",
        "",
        "## What it is for",
        "",
        f"- Task: {task['kind']}"
        + (f", labels {', '.join(task['labels'])}" if task.get("labels") else "")
        + (f", fields {', '.join(task['fields'])}" if task.get("fields") else ""),
        *_prompt_lines(m),
        f"- Hypothesis v{hyp.get('version')}: {hyp.get('behaviour')}",
        f"- Primary metric: {hyp.get('primary_metric')} (must improve by at least "
        f"{hyp.get('min_improvement')})",
        "",
        "## Base model (verified by hash before loading)",
        "",
        f"- Name: {base.get('name')}, revision {base.get('revision') or '-'}",
        *(
            [f"- Hub: `{base['hub']['repo_id']}` at commit `{base['hub']['commit']}`"]
            if base.get("hub")
            else []
        ),
        f"- Architecture: {base.get('architecture')}",
        f"- Identity sha256: `{base.get('sha256')}`",
        "",
        "| file | sha256 |",
        "|---|---|",
        *[f"| {n} | `{h}` |" for n, h in sorted((base.get("files") or {}).items())],
        "",
        "## Results on the validation split",
        "",
    ]
    lines += _results_lines(m.get("results"))
    lines += ["", "## Guardrails", ""]
    lines += _guardrail_lines(m.get("guardrails") or {})
    lines += ["", "## Limitations", ""]
    lines += [f"- {line}" for line in m.get("limitations") or []] or ["- none recorded"]
    lines += _loading_lines(m)
    env = (m.get("environment") or {}).get("training") or {}
    if env:
        lines.append(
            f"- Environment: torch {env.get('torch')}, backend {env.get('backend')}, "
            f"devices {', '.join(env.get('gpus') or []) or env.get('cpu')}"
        )
    return "\n".join(lines) + "\n"


def _results_lines(res: Mapping[str, Any] | None) -> list[str]:
    """The results against the baseline: each metric with its paired interval."""
    lines: list[str] = []
    if not res:
        lines.append("Not compared with a baseline (see limitations).")
    else:
        lines += [
            f"Against baseline `{res['baseline']['run_id']}`, {res.get('n_paired')} paired "
            f"examples, 95% paired bootstrap intervals.",
            "",
            "| metric | baseline | this model | delta | 95% CI |",
            "|---|---|---|---|---|",
        ]
        for name, v in (res.get("metrics") or {}).items():
            ci = (
                f"[{number_text(v.get('ci_low'))}, {number_text(v.get('ci_high'))}]"
                if v.get("ci_low") is not None
                else "-"
            )
            lines.append(
                f"| {name} | {number_text(v.get('baseline'))} | {number_text(v.get('variant'))} | "
                f"{number_text(v.get('delta'))} | {ci} |"
            )
        lines += ["", primary_verdict(res.get("primary") or {})]
    return lines


def _guardrail_lines(g: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    if not g.get("verdicts"):
        lines.append("Not checked.")
    else:
        lines.append(f"All pass: {g.get('pass')}.")
        lines.append("")
        lines += ["| rule | item | value | bound | pass |", "|---|---|---|---|---|"]
        for v in g["verdicts"]:
            lines.append(
                f"| {v['rule']} | {v.get('item') if v.get('item') is not None else '-'} | "
                f"{number_text(v.get('value'))} | {number_text(v.get('bound'))} | {v['pass']} |"
            )
    return lines


def _loading_lines(m: Mapping[str, Any]) -> list[str]:
    """How to check the base and load the export (transformers, peft), then how it was trained."""
    base, task = m["base"], m["task"]
    arch = base.get("architecture")
    auto = {
        "encoder": "AutoModelForSequenceClassification",
        "image": "AutoModelForImageClassification",
    }.get(arch, "AutoModelForCausalLM")
    reader = "AutoImageProcessor" if arch == "image" else "AutoTokenizer"
    labelled = arch in ("encoder", "image") and task.get("labels")
    head = f", num_labels={len(task['labels'])}" if labelled else ""
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
    lines += _processor_lines((m.get("limitations_detail") or {}).get("processor"))
    lines += [
        "```",
        "",
        "## Training",
        "",
        f"- Adaptation: {json.dumps(_applied_adaptation(m.get('adaptation')), sort_keys=True)}",
        f"- Training: {json.dumps(m.get('training'), sort_keys=True)}",
        f"- Data snapshot: `{m.get('data_snapshot')}`",
        f"- Config sha256: `{m.get('config_sha256')}`",
    ]
    return lines


def _load_lines(m: Mapping[str, Any], auto: str, head: str) -> list[str]:
    """The Python lines that load the export: the adapter (QLoRA: onto the base in 4 bits with
    the recorded settings) or the whole model, both from the folder itself."""
    art = m["artifact"]
    if art["kind"] != "adapter":
        if not art.get("merged"):
            return ["", f'model = {auto}.from_pretrained("THIS_FOLDER")']
        dtype = TORCH_DTYPES[art["dtype"]]
        return ["import torch", "", f'model = {auto}.from_pretrained("THIS_FOLDER", dtype={dtype})']
    lines = ["from peft import PeftModel", ""]
    q = (m.get("base") or {}).get("quantization")
    if art.get("method") == "qlora" and q:
        compute = TORCH_DTYPES[q["compute_dtype"]]
        lines = [
            "import torch",
            "from transformers import BitsAndBytesConfig",
            *lines,
            "bnb = BitsAndBytesConfig(",
            f'    load_in_4bit=True, bnb_4bit_quant_type="{q["quant_type"]}",',
            f"    bnb_4bit_use_double_quant={q['double_quant']}, bnb_4bit_compute_dtype={compute},",
            ")",
        ]
        head += ", quantization_config=bnb"
    return lines + [
        f'base = {auto}.from_pretrained("/path/to/base"{head})',
        'model = PeftModel.from_pretrained(base, "THIS_FOLDER")',
    ]


def primary_verdict(primary: dict[str, Any]) -> str:
    """The primary metric's two verdicts side by side: its interval's and its threshold's."""
    from tunelab.stages.compare.stage import interval_verdict

    meets = primary.get("meets_min_improvement")
    threshold = "-" if meets is None else ("met" if meets else "not met")
    return (
        f"Primary metric {primary.get('metric')}: delta {number_text(primary.get('delta'))}, "
        f"95% interval {interval_verdict(primary)} (significant: "
        f"{'yes' if primary.get('significant') else 'no'}); minimum improvement "
        f"{number_text(primary.get('min_improvement'))}: {threshold}."
    )


def _processor_lines(processor: dict[str, Any] | None) -> list[str]:
    """What the exported image processor gives, as a comment under the loading lines."""
    if not processor:
        return []
    if processor.get("matches"):
        return [
            "# its pixel_values are the training transforms' (RGB conversion on, transparency "
            "on white), checked at export"
        ]
    return ["# NOT the training transforms: see Limitations"]
