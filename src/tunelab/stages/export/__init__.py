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
- `write`: `export_run`, the export itself
- `merge`: `merge_into`, `--merge` (an adapter merged into its dequantized base, checked)
- `card`: `model_card`, the README.md written from the manifest
- `check`: `check_export`, an export checked against its manifest and a base, then run
"""

from tunelab.stages.export.check import ExampleMismatch, check_export
from tunelab.stages.export.limitations import failure_kinds, limitation_lines, regressions
from tunelab.stages.export.manifest import FORMAT, MANIFEST, manifest_sha256
from tunelab.stages.export.write import export_run

__all__ = [
    "FORMAT",
    "MANIFEST",
    "ExampleMismatch",
    "check_export",
    "export_run",
    "failure_kinds",
    "limitation_lines",
    "manifest_sha256",
    "regressions",
]
