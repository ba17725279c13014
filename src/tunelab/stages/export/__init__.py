"""`tunelab export` and `tunelab check-export`: a trained model bound to its exact base.

An export folder (`records/exports/<id>/`, or `--out DIR`), written atomically:

```
adapter_config.json      LoRA and QLoRA, at the top (`PeftModel.from_pretrained(base, DIR)`):
adapter_model.safetensors  peft format (an encoder's classification head is inside, in
                         modules_to_save); QLoRA: for the base loaded in 4 bits as recorded
config.json              full, freeze or `--merge`: a whole model (save_pretrained), at the top
model.safetensors
tokenizer/               the base's tokenizer files, byte for byte
example.json             one validation example with its recorded prediction
README.md                the model card
tunelab-manifest.json    base identity (sha256 of every weight and tokenizer file), config,
                         data snapshot, hypothesis, environment, metrics against the baseline,
                         guardrails, limitations, sha256 of every exported file, and its own
                         sha256 (`manifest_sha256`, over the manifest without that field)
```

`check_export(dir, base)` refuses an edited manifest, a changed or added file, any pickle file,
and a base folder whose files do not match the recorded hashes (ExportError listing each file);
then it loads the base with the adapter (plain `PeftModel.from_pretrained`) or the full model and
runs the recorded example. Nothing is pickled: tensors are safetensors, the rest JSON.

- `manifest`: the format, the folder's names, `manifest_sha256`, file hashes
- `limitations`: what the model card and the manifest say the model cannot be trusted with
- `stage`: `run`, the export itself
- `merge`: `merge_into`, `--merge` (an adapter merged into its dequantized base, checked)
- `card`: `model_card`, the README.md written from the manifest
- `check`: `check_export`, an export checked against its manifest and a base, then run

`stage.run(study, run_id, *, out=None, notes=(), merge_dtype=None, merge_tolerance=None) ->
(path, manifest)`. The manifest: `format` (`tunelab-export/2`; `READABLE_FORMATS` also reads
`/1`, whose weights sat in `adapter/` or `model/`), `artifact {kind, dir, method, format,
weights, merged?, dtype?}`, `merge` (None, or `merge.merge_into`'s figures: dtype,
dequantized_from, example_ids, examples, positions, logits_max_abs_diff, logits_max_abs,
greedy_agreement, prediction_agreement, tolerance, within_tolerance), `run_id`, `base` (the
identity without `path`, with `architecture`; a QLoRA run's `quantization`), `task`, `config`,
`data_snapshot`, `hypothesis`, `environment {training, export}`, `results` (compare's row for
the run or None), `guardrails {pass, verdicts}`, `limitations` (sentences),
`limitations_detail` (its `truncation` read from the run's preprocess.json counts; an image
export's `processor`), `files {relpath: sha256}`, `manifest_sha256`. Its ledger event `export`
holds `seconds`. `check_export(dir, base_path)` raises ExportError; `base_path` may be a hub id
`org/repo[@rev]` (`check.resolve_base_arg`; another commit than the manifest's
`base.hub.commit` is refused); `check.check_files` checks hashes, pickles and safetensors
headers, `check.check_binding(dir, manifest)` compares `adapter_config.json` with the manifest;
a differing example output raises `ExampleMismatch` (exit 1). The package re-exports
`ExampleMismatch`, `MANIFEST`, `FORMAT`, `manifest_sha256`, `limitation_lines`, `regressions`,
`failure_kinds`.
"""

from tunelab.stages.export.check import ExampleMismatch, check_export
from tunelab.stages.export.limitations import failure_kinds, limitation_lines, regressions
from tunelab.stages.export.manifest import FORMAT, MANIFEST, manifest_sha256

__all__ = [
    "FORMAT",
    "MANIFEST",
    "ExampleMismatch",
    "check_export",
    "failure_kinds",
    "limitation_lines",
    "manifest_sha256",
    "regressions",
]
