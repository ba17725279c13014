"""`tunelab launch skypilot|slurm`: write the file an engine runs to train the study's run.

`run(study, engine, options, out=None) -> Written` builds the job from the study and its latest
plan (`spec.hand_off`), renders it for the engine and writes it to `out` (default
`<study>/launch/<name>.sky.yaml` or `<name>.sbatch`), replaced when written again. The file
is not a record: it names the plan it came from, and the run it starts records itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunelab.core.records import write_bytes_atomic
from tunelab.core.study import Study
from tunelab.stages.launch import skypilot, slurm
from tunelab.stages.launch.spec import HandOff, LaunchOptions, hand_off

SUFFIX = {"skypilot": ".sky.yaml", "slurm": ".sbatch"}
SUBMIT = {"skypilot": "sky jobs launch {path}", "slurm": "sbatch {path}"}


@dataclass(frozen=True)
class Written:
    path: Path
    text: str
    hand_off: HandOff

    @property
    def submit(self) -> str:
        """The command that hands the file to its engine."""
        return SUBMIT[self.hand_off.engine].format(path=self.path)


def run(study: Study, engine: str, options: LaunchOptions, out: Path | None = None) -> Written:
    """Write the engine's file for the run `options.name`; raises ConfigError on bad input
    (nothing is written then)."""
    h = hand_off(study, engine, options)
    text = skypilot.render(h) if engine == "skypilot" else slurm.render(h)
    path = Path(out) if out else study.root / "launch" / f"{h.name}{SUFFIX[engine]}"
    write_bytes_atomic(path, text.encode(), overwrite=True)
    if engine == "slurm":
        path.chmod(0o755)
    return Written(path.resolve(), text, h)
