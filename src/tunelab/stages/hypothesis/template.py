"""`tunelab init`: a commented study.yaml per task kind, valid as written except the hypothesis.

The hypothesis fields start as TODO so that `tunelab register` refuses them until a person has
written the question down.

`render_study_yaml(task, name)`, `init_study(dir, task, name)`; `TASK_KINDS` is what
`tunelab init --task` takes.
"""

from __future__ import annotations

from pathlib import Path

from tunelab.core.errors import StudyError
from tunelab.core.records import write_bytes_atomic

_HEADER = """\
# tunelab study: {name}
# Edit this file, then: tunelab validate -> tunelab register -> tunelab data -> tunelab inspect
#   -> tunelab baseline -> tunelab smoke -> tunelab size -> tunelab train -> tunelab eval RUN
#   -> tunelab compare -> tunelab verify RUN -> tunelab export RUN -> tunelab plan -> tunelab report
# Every key below is known to tunelab; an unknown key is an error. Override any value on the
# command line with --set section.field=value (e.g. --set training.lr=1e-4).
name: {name}

task:
  kind: {task}  # classification | format | extraction | image_classification
{task_block}
# The question, locked by `tunelab register` before any training. Replace every TODO.
hypothesis:
  behaviour: "TODO: the behaviour to improve, e.g. 'route support tickets to the right team'"
  rationale: "TODO: why fine-tuning should improve it"
  expected_effect: "TODO: expected effect size, e.g. '{metric} +0.05 over the base model'"
  primary_metric: {metric}   # the metric the decision rests on
  min_improvement: 0.02       # smallest gain over the baseline that counts

# What must NOT get worse. Each rule: metric, scope (overall | every_category | every_field),
# op (>=, <=, >, <), value, and relative_to: baseline for a bound relative to the base model.
guardrails:
{guardrails}
{data_block}model:
  path: {model_path}          # {model_comment}
  gguf_file: null             # or a .gguf file inside path, converted once to a cached folder
  architecture: {architecture}  # auto | encoder | causal_lm | image
  trust_remote_code: false
  dtype: float32

adaptation:
  method: lora                # full | lora | qlora (LoRA on a 4-bit base) | freeze
  target_modules: {targets}
  rank: 8
  alpha: 16
  dropout: 0.0
  modules_to_save: {modules_to_save}
  # trainable: []             # method freeze: the modules left trainable
  # quantization: {{quant_type: nf4, double_quant: true, compute_dtype: bf16}}  # method qlora

{preprocess_block}training:
  seed: 0
  micro_batch_size: 8
  grad_accum_steps: 1
  max_steps: 100
  optimizer: AdamW           # any torch.optim name; AdamW8bit | PagedAdamW8bit (qlora extra)
  lr: {lr}
  weight_decay: 0.0
  schedule: linear            # constant | linear | cosine
  warmup_steps: 5
  grad_clip: 1.0
  precision: auto             # auto (bf16 on a CUDA GPU with bf16, else fp32) | fp32 | bf16 | fp16
  compile: false              # torch.compile each decoder block
  activation_checkpointing: false
  eval_every_steps: 50
  checkpoint_every_steps: 50
  keep_last_checkpoints: 2

evaluation:                   # locked with the hypothesis: every variant is evaluated the same way
  split: validation
  batch_size: 16
{generation_lines}  seed: 0

budget:
  rental_days: 7              # 3 | 7 | 30
  gpu_hour_price: 2.5
  gpu: "1x H100 80GB"
  num_variants: 4
"""

_TEXT_MODEL = "a local transformers folder (no hub access assumed)"

_TEXT_DATA = """\
data:
  source:
    format: {source_format}   # jsonl | csv | parquet | folder (per label) | hf_disk | hub (name:)
    path: {source_path}
  fields:                     # column names in the source
    id: null                  # a column with a stable id per example (null: a content hash)
    text: text
    label: {label_field}
    target: {target_field}
    split: null               # a column with your own train/validation/test split, if any
  cleaning:                   # applied in order; `tunelab data` reports what each rule touched
    - rule: unicode_nfc
    - rule: normalize_whitespace
    - rule: drop_empty
    - rule: drop_longer_than
      max_chars: 20000
  splits: {{train: 0.8, validation: 0.1, test: 0.1, seed: 0, stratify: {stratify}}}{stratify_note}
  dedup:
    exact: true
    near: true
    threshold: 0.8            # Jaccard similarity of word 5-shingles (MinHash + LSH)
    policy: drop_eval         # drop_eval | drop_all_but_one | report_only

"""

_TEXT_PREPROCESS = """\
preprocess:
  max_seq_len: {max_seq_len}
  template: chat              # chat (tokenizer's chat template) | plain (plain_template)
  truncation_side: right      # which side of the input is cut when too long
  train_on_prompt: false
  allow_target_truncation: false

"""

_GENERATION = """\
  max_new_tokens: 64
  decoding: greedy
"""

_IMAGE_DATA = """\
data:
  source:
    format: folder            # folder: data/<label>/*.png|jpg|jpeg|webp|bmp|tif|tiff|gif
    path: data/               # or jsonl | csv | parquet (fields.image: a column of paths),
                              # hf_disk | hub (fields.image: a datasets Image column)
  fields:
    image: null               # folder: null; otherwise the column holding each image
    label: label              # a string column, or a datasets ClassLabel (its names)
    split: null               # a column with your own train/validation/test split, if any
  cleaning: []                # the cleaning rules are for text
  splits: {train: 0.8, validation: 0.1, test: 0.1, seed: 0, stratify: true}
  dedup:
    exact: true               # equal decoded pixels (a copy saved in another format counts)
    near: true
    threshold: 0.95           # difference-hash similarity 1 - d/64 (0.95: at most 3 bits)
    policy: drop_eval         # drop_eval | drop_all_but_one | report_only

"""

_IMAGE_PREPROCESS = """\
preprocess:
  image:                      # null: the value of the model's preprocessor_config.json
    resize: null              # square side in pixels
    crop: null                # center crop side
    mean: null                # per channel, e.g. [0.5, 0.5, 0.5]
    std: null
    train_random_crop: 0.9    # training only: a random square of 90 % of the side, resized
    train_flip: true          # training only: random horizontal flip (false for digits, text)

"""

_TASKS = {
    "classification": dict(
        task_block="  labels: null               # read from the data when null\n"
        '  instruction: "Classify the text into one of the categories."\n',
        metric="macro_f1",
        guardrails='  - {metric: f1, scope: every_category, op: ">=", value: -0.02, relative_to: baseline}\n',
        source_format="folder",
        source_path="data/",
        label_field="label",
        target_field="null",
        model_path="models/all-MiniLM-L6-v2",
        architecture="encoder",
        targets="[query, value]",
        modules_to_save="[classifier]",
        max_seq_len=256,
        lr="5.0e-4",
        model_comment=_TEXT_MODEL,
    ),
    "format": dict(
        task_block='  instruction: "Answer with a JSON object."\n'
        "  json_schema: {type: object, required: [answer], properties: {answer: {type: string}}}\n"
        "  regex: null                # or a Python regular expression the whole answer must\n"
        "                             # match (then json_schema: null), e.g. '(spam|ham)'\n",
        metric="format_valid_rate",
        stratify="false",
        stratify_note="  # no labels to stratify by",
        guardrails='  - {metric: format_valid_rate, scope: overall, op: ">=", value: 0.99}\n',
        source_format="jsonl",
        source_path="data/examples.jsonl",
        label_field="null",
        target_field="target",
        model_path="models/smollm2-135m-instruct",
        architecture="causal_lm",
        targets="all-linear",
        modules_to_save="[]",
        max_seq_len=512,
        lr="2.0e-4",
        model_comment=_TEXT_MODEL,
    ),
    "extraction": dict(
        task_block='  instruction: "Extract the fields as a JSON object."\n'
        "  json_schema:\n"
        "    type: object\n"
        "    required: [sender, subject]\n"
        "    properties: {sender: {type: string}, subject: {type: string}}\n",
        metric="field_micro_f1",
        guardrails='  - {metric: json_valid_rate, scope: overall, op: ">=", value: 0.99}\n'
        '  - {metric: field_presence_rate, scope: every_field, op: ">=", value: -0.02, relative_to: baseline}\n',
        source_format="jsonl",
        source_path="data/examples.jsonl",
        label_field="null",
        target_field="target",
        model_path="models/smollm2-135m-instruct",
        architecture="causal_lm",
        targets="all-linear",
        modules_to_save="[]",
        max_seq_len=512,
        lr="2.0e-4",
        model_comment=_TEXT_MODEL,
    ),
    "image_classification": dict(
        task_block="  labels: null               # read from the data (the label folders) when null\n",
        metric="macro_f1",
        guardrails='  - {metric: accuracy, scope: overall, op: ">=", value: -0.01, relative_to: baseline}\n'
        '  - {metric: macro_f1, scope: overall, op: ">=", value: -0.01, relative_to: baseline}\n'
        '  - {metric: f1, scope: every_category, op: ">=", value: -0.02, relative_to: baseline}\n',
        model_path="models/vit-base",
        model_comment="a local image model folder, with its preprocessor_config.json",
        architecture="image",
        targets="[q_proj, v_proj]",
        modules_to_save="[classifier]",
        lr="5.0e-4",
        data_block=_IMAGE_DATA,
        preprocess_block=_IMAGE_PREPROCESS,
        generation_lines="",
    ),
}

TASK_KINDS = tuple(_TASKS)


def _blocks(values: dict[str, str]) -> dict[str, str]:
    """The data, preprocess and evaluation lines of a task: the text ones unless it has its own."""
    if "data_block" in values:
        return values
    return {
        **values,
        "data_block": _TEXT_DATA.format(**{"stratify": "true", "stratify_note": "", **values}),
        "preprocess_block": _TEXT_PREPROCESS.format(**values),
        "generation_lines": _GENERATION,
    }


def render_study_yaml(task: str, name: str) -> str:
    if task not in _TASKS:
        raise StudyError(
            f"unknown task kind {task!r}", hint=f"choose one of {', '.join(TASK_KINDS)}"
        )
    return _HEADER.format(name=name, task=task, **_blocks(_TASKS[task]))


def init_study(root: Path, task: str, name: str | None = None) -> Path:
    root = Path(root)
    path = root / "study.yaml"
    if path.exists():
        raise StudyError(f"{path} already exists", hint="edit it, or init another folder")
    text = render_study_yaml(task, name or root.resolve().name)
    root.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, text.encode("utf-8"))
    (root / "records").mkdir(exist_ok=True)
    return path
