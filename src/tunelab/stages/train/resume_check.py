"""What a resume reads besides the weights, checked before the run is touched.

A checkpoint's files can match their recorded sha256 and still be unusable: a buggy writer or a
hand edit that rewrote the hashes too. The optimizer's moments must have the shape and dtype of
the parameter they belong to, and the generator states the structure torch, numpy and python
restore; otherwise the run would start, crash inside torch and be recorded as failed.
`resume_state_problems` compares every state file against the layout that `optimizer_layout`
and `rng_layout` recorded in state.json when the checkpoint was written (and, for checkpoints
written without one, against the checkpoint's own structure). Reads headers and JSON only: no
torch.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from tunelab.core.errors import CheckpointError
from tunelab.core.records import read_json
from tunelab.core.safetensors_header import safetensors_problems, tensor_infos

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_REST = "optimizer.json"
SCHEDULER = "scheduler.json"
RNG = "rng.safetensors"
# optimizer state tensors that have their parameter's shape and dtype (torch.optim's names)
PARAM_SHAPED = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg"}
SAFETENSORS_DTYPE = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "uint8": "U8",
    "int64": "I64",
    "int32": "I32",
}
NUMPY_KEYS = 624  # MT19937's key array
PYTHON_STATE = 625  # random.getstate()[1]: the key array and its position


def optimizer_layout(model: Any, optimizer: Any) -> list[list[Any]]:
    """[[parameter name, shape, dtype, sorted state keys], ...] in the optimizer's own order (the
    integer ids of its state_dict), recorded in state.json at save."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            dtype = SAFETENSORS_DTYPE.get(str(p.dtype).removeprefix("torch."), str(p.dtype))
            keys = sorted(optimizer.state.get(p, {}))
            out.append([names.get(id(p), "?"), list(p.shape), dtype, keys])
    return out


def rng_layout(tensors: dict[str, Any]) -> dict[str, list[Any]]:
    """{name: [dtype, shape]} of the generator tensors written to rng.safetensors."""
    return {
        n: [SAFETENSORS_DTYPE.get(str(t.dtype).removeprefix("torch."), str(t.dtype)), list(t.shape)]
        for n, t in tensors.items()
    }


def require_resume_state(path: Path, state: dict[str, Any]) -> None:
    """Raise CheckpointError naming the file and tensor of each problem `resume_state_problems`
    finds in checkpoint `path` (its state.json already read)."""
    problems = resume_state_problems(path, state)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointError(
            f"{path}: {len(problems)} problem(s) in the state a resume restores:\n{lines}{more}",
            hint="this checkpoint cannot continue the run; delete it to resume from the one "
            "before, or start a new run with `tunelab train`",
        )


def resume_state_problems(path: Path, state: dict[str, Any]) -> list[str]:
    """Every problem of a checkpoint's optimizer, scheduler and generator states."""
    problems = []
    # FSDP's full fine-tune: the optimizer's shards are in dcp/, or in the shard store
    sharded = (path / "dcp").is_dir() or bool(state.get("shards"))
    wanted = [SCHEDULER, RNG] + ([] if sharded else [OPTIMIZER_TENSORS, OPTIMIZER_REST])
    for name in wanted:
        if not (path / name).is_file():
            problems.append(f"{name}: missing")
    if problems:
        return problems
    for name in (RNG, OPTIMIZER_TENSORS):
        if (path / name).is_file() and (bad := safetensors_problems(path / name)):
            problems.append(f"{name}: {'; '.join(bad)}")
    if problems:
        return problems
    if not isinstance(_json(path / SCHEDULER, problems), dict):
        problems.append(f"{SCHEDULER}: not a JSON object")
    if not sharded:
        problems += _optimizer_problems(path, state.get("optimizer_layout"))
    problems += _rng_problems(path, state)
    return problems


def _json(path: Path, problems: list[str]) -> Any:
    try:
        return read_json(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable JSON is one located problem
        problems.append(f"{path.name}: {getattr(exc, 'message', exc)}")
        return None


# ------------------------------------------------------------------ optimizer


def _optimizer_problems(path: Path, layout: list[list[Any]] | None) -> list[str]:
    problems: list[str] = []
    meta = _json(path / OPTIMIZER_REST, problems)
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    rest = meta.get("state") if isinstance(meta, dict) else None
    if not isinstance(groups, list) or not isinstance(rest, dict):
        return problems or [f"{OPTIMIZER_REST}: no 'param_groups' list and 'state' object"]
    ids: list[Any] = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            problems.append(f"{OPTIMIZER_REST}: param_groups[{i}] has no list of 'params'")
        else:
            ids += g["params"]
    if problems:
        return problems
    if layout is not None and ids != list(range(len(layout))):
        problems.append(
            f"{OPTIMIZER_REST}: param_groups list {len(ids)} parameter(s); the checkpoint's "
            f"layout records {len(layout)}"
        )
        return problems
    tensors = tensor_infos(path / OPTIMIZER_TENSORS)
    found: dict[int, dict[str, tuple[str, list[int]]]] = {}
    for name, info in tensors.items():
        pid, _, key = name.partition(".")
        if not pid.isdigit() or int(pid) not in ids or not key:
            problems.append(f"{OPTIMIZER_TENSORS}: tensor {name!r} names no parameter")
            continue
        found.setdefault(int(pid), {})[key] = info
    for pid in rest:
        if not (isinstance(pid, str) and pid.isdigit() and int(pid) in ids):
            problems.append(f"{OPTIMIZER_REST}: state {pid!r} names no parameter")
    if layout is None:
        return problems + _consistent_moments(found)
    for pid, (pname, shape, dtype, keys) in enumerate(layout):
        problems += _param_problems(pid, pname, shape, dtype, keys, found.get(pid, {}), rest)
    return problems


BNB_STATE = "__bnb_optimizer_quant_state__"


def _param_problems(
    pid: int,
    pname: str,
    shape: list[int],
    dtype: str,
    keys: list[str],
    tensors: dict[str, tuple[str, list[int]]],
    rest: dict[str, Any],
) -> list[str]:
    """One parameter's optimizer state against its recorded layout."""
    where = f"{OPTIMIZER_TENSORS}: parameter {pid} ({pname})"
    scalars = rest.get(str(pid), {})
    have = sorted({k.split("/", 1)[0] for k in tensors} | set(scalars))
    # bitsandbytes' 8-bit optimizers save their quantized state under one key of their own
    if BNB_STATE in have:
        return []
    if have != sorted(keys):
        missing = sorted(set(keys) - set(have))
        extra = sorted(set(have) - set(keys))
        what = "; ".join(
            x for x in (missing and f"missing {missing}", extra and f"unexpected {extra}") if x
        )
        return [f"{where}: state {what} (recorded: {sorted(keys)})"]
    problems = []
    for key, (got_dtype, got_shape) in sorted(tensors.items()):
        if key in PARAM_SHAPED and (got_shape, got_dtype) != (shape, dtype):
            problems.append(
                f"{where}: tensor '{pid}.{key}' is {got_dtype} {got_shape}, the parameter "
                f"{dtype} {shape}"
            )
        elif key == "step" and _numel(got_shape) != 1:
            problems.append(f"{where}: tensor '{pid}.step' has shape {got_shape}, not a scalar")
    return problems


def _consistent_moments(found: dict[int, dict[str, tuple[str, list[int]]]]) -> list[str]:
    """Without a recorded layout: each parameter's moments agree with each other."""
    problems = []
    for pid, tensors in sorted(found.items()):
        shaped = {k: v for k, v in tensors.items() if k in PARAM_SHAPED}
        if len({(d, tuple(s)) for d, s in shaped.values()}) > 1:
            shown = ", ".join(f"{k} {d} {s}" for k, (d, s) in sorted(shaped.items()))
            problems.append(f"{OPTIMIZER_TENSORS}: parameter {pid}: moments disagree ({shown})")
    return problems


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------ generators


def _rng_problems(path: Path, state: dict[str, Any]) -> list[str]:
    problems = []
    tensors = tensor_infos(path / RNG)
    rest = state.get("rng")
    if not isinstance(rest, dict):
        return [f"state.json: 'rng' is {type(rest).__name__}, not the generators' object"]
    recorded = state.get("rng_layout")
    if recorded is None:
        cuda = rest.get("cuda_devices", 0)
        recorded = {"numpy.keys": ["I64", [NUMPY_KEYS]]}
        recorded |= {f"cuda.{i}": None for i in range(cuda if isinstance(cuda, int) else 0)}
        recorded["torch"] = None
    for name in sorted(set(recorded) | set(tensors)):
        want, got = recorded.get(name, "absent"), tensors.get(name)
        if got is None:
            problems.append(f"{RNG}: tensor {name!r} missing")
        elif want == "absent":
            problems.append(f"{RNG}: tensor {name!r} was not written by tunelab")
        elif want is not None and [got[0], got[1]] != want:
            problems.append(f"{RNG}: tensor {name!r} is {got[0]} {got[1]}, recorded {want}")
        elif want is None and (got[0] != "U8" or len(got[1]) != 1):
            problems.append(f"{RNG}: tensor {name!r} is {got[0]} {got[1]}, not a U8 byte state")
    problems += [f"state.json: rng.{p}" for p in generator_rest_problems(rest)]
    ranks = state.get("rank_rng", [])
    world = state.get("world_size", 1)
    if not isinstance(ranks, list) or len(ranks) != max(int(world) - 1, 0):
        return [*problems, f"state.json: rank_rng holds no state for each of {world - 1} rank(s)"]
    for i, saved in enumerate(ranks, start=1):
        problems += [f"state.json: rank_rng[{i - 1}] (rank {i}): {p}" for p in _encoded(saved)]
    return problems


def generator_rest_problems(rest: dict[str, Any]) -> list[str]:
    """numpy's and python's generator fields, as `checkpoint.restore_rng` needs them."""
    problems = []
    n, p = rest.get("numpy"), rest.get("python")
    if not isinstance(n, dict) or n.get("kind") != "MT19937":
        problems.append("numpy: not an MT19937 state")
    elif not (isinstance(n.get("pos"), int) and 0 <= n["pos"] <= NUMPY_KEYS):
        problems.append(f"numpy.pos: {n.get('pos')!r} is not a position in 0..{NUMPY_KEYS}")
    elif not isinstance(n.get("has_gauss"), int) or not isinstance(n.get("cached"), int | float):
        problems.append("numpy: has_gauss or cached is not a number")
    state = p.get("state") if isinstance(p, dict) else None
    if not isinstance(p, dict) or not isinstance(p.get("version"), int):
        problems.append("python: no version")
    elif not (
        isinstance(state, list)
        and len(state) == PYTHON_STATE
        and all(isinstance(x, int) for x in state)
    ):
        problems.append(f"python.state: not a list of {PYTHON_STATE} integers")
    elif p.get("gauss_next") is not None and not isinstance(p["gauss_next"], int | float):
        problems.append("python.gauss_next: not a number")
    return problems


def _encoded(saved: Any) -> list[str]:
    """Another rank's generators as `checkpoint.encode_rng` wrote them."""
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        return ["no generator tensors"]
    problems = []
    for name, t in saved["tensors"].items():
        try:
            size = len(base64.b64decode(t["base64"], validate=True))
            ok = (
                t["dtype"] in ("uint8", "int64") and size % (8 if t["dtype"] == "int64" else 1) == 0
            )
        except (TypeError, KeyError, binascii.Error):
            ok, size = False, 0
        if not ok or not size:
            problems.append(f"tensor {name!r}: not a base64 uint8/int64 state")
    if "torch" not in saved["tensors"] or "numpy.keys" not in saved["tensors"]:
        problems.append("the torch or numpy generator is missing")
    rest = saved.get("rest")
    problems += generator_rest_problems(rest) if isinstance(rest, dict) else ["no 'rest'"]
    return problems
