"""Real example data sets built from the packaged assets (no download).

- SpamAssassin emails -> extraction examples: the email (key headers + the start of the body)
  and the gold JSON {sender, subject, date, list} read from its headers.
- SpamAssassin emails -> spam/ham classification examples.
The BBC topics need no conversion: `data.source.format: folder` reads them where they are.
"""

from __future__ import annotations

import email
import email.policy
import json
import random
import re
from email.utils import parseaddr, parsedate_to_datetime
from pathlib import Path
from typing import Any

from tunelab.core.records import write_bytes_atomic

_GROUPS_HAM = ("easy-ham-1", "easy-ham-2", "hard-ham-1")
_GROUPS_SPAM = ("spam-1", "spam-2")
_KEEP_HEADERS = ("From", "To", "Date", "Subject", "List-Id")


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8", errors="replace"))


def _header(msg: email.message.Message, name: str) -> str | None:
    value = msg.get(name)
    if value is None:
        return None
    return re.sub(r"\s+", " ", str(value)).strip() or None


def _body_start(msg: email.message.Message, max_chars: int) -> str:
    part = msg
    if msg.is_multipart():
        part = next((p for p in msg.walk() if p.get_content_type() == "text/plain"), None)
        if part is None:
            return ""
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset() or "latin-1"
    try:
        text = payload.decode(charset, errors="replace")
    except LookupError:
        text = payload.decode("latin-1", errors="replace")
    return re.sub(r"\s+", " ", text).strip()[:max_chars]


def email_fields(raw: str) -> dict[str, Any] | None:
    """Gold fields from an RFC 822 email's headers, or None when one is unusable."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    sender = parseaddr(_header(msg, "From") or "")[1].lower()
    subject = _header(msg, "Subject")
    date_raw = _header(msg, "Date")
    if not sender or "@" not in sender or not subject or not date_raw:
        return None
    try:
        date = parsedate_to_datetime(date_raw).date().isoformat()
    except (TypeError, ValueError, IndexError):
        return None
    list_id = _header(msg, "List-Id")
    if list_id:
        m = re.search(r"<([^>]+)>", list_id)
        list_id = m.group(1) if m else list_id
    return {"sender": sender, "subject": subject, "date": date, "list": list_id}


def email_text(raw: str, body_chars: int = 300) -> str:
    """What the model reads: the key headers as they are, then the start of the body."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    lines = [f"{h}: {_header(msg, h)}" for h in _KEEP_HEADERS if _header(msg, h)]
    return "\n".join(lines) + "\n\n" + _body_start(msg, body_chars)


def _files(root: Path, groups: tuple[str, ...]) -> list[Path]:
    return sorted(p for g in groups for p in (root / g).glob("*.json"))


def write_spam_extraction(root: Path, out: Path, num_examples: int, seed: int = 0) -> Path:
    """JSONL of {id, text, target} where target is the gold JSON of the email's headers."""
    files = _files(root, _GROUPS_HAM + _GROUPS_SPAM)
    random.Random(seed).shuffle(files)
    rows = []
    for p in files:
        rec = _load(p)
        fields = email_fields(rec["text"])
        if fields is None or len(fields["subject"]) > 120:
            continue
        rows.append(
            {
                "id": f"{rec['group']}/{rec['id']}",
                "text": email_text(rec["text"]),
                "target": json.dumps(fields, ensure_ascii=False),
            }
        )
        if len(rows) >= num_examples:
            break
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return write_bytes_atomic(out, text.encode("utf-8"), overwrite=True)


def write_spam_classification(root: Path, out: Path, num_per_class: int, seed: int = 0) -> Path:
    """JSONL of {id, text, label} with label spam or ham."""
    rows = []
    for label, groups in (("ham", _GROUPS_HAM), ("spam", _GROUPS_SPAM)):
        files = _files(root, groups)
        random.Random(seed).shuffle(files)
        for p in files[:num_per_class]:
            rec = _load(p)
            rows.append(
                {
                    "id": f"{rec['group']}/{rec['id']}",
                    "text": email_text(rec["text"], 600),
                    "label": label,
                }
            )
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return write_bytes_atomic(out, text.encode("utf-8"), overwrite=True)


def write_spam_format(root: Path, out: Path, num_per_class: int, seed: int = 0) -> Path:
    """JSONL of {id, text, target} where target is the JSON verdict {"verdict": "spam" | "ham"}."""
    tmp = out.with_suffix(".classification.tmp")
    write_spam_classification(root, tmp, num_per_class, seed)
    rows = [json.loads(line) for line in tmp.read_text(encoding="utf-8").splitlines()]
    tmp.unlink()
    text = "".join(
        json.dumps(
            {"id": r["id"], "text": r["text"], "target": json.dumps({"verdict": r["label"]})}
        )
        + "\n"
        for r in rows
    )
    return write_bytes_atomic(out, text.encode("utf-8"), overwrite=True)


def main(argv: list[str] | None = None) -> None:
    """python -m tunelab.demo.data extraction|classification|format OUT.jsonl [--n N]"""
    import argparse

    from tunelab.core.assets import spamassassin_path

    ap = argparse.ArgumentParser(prog="python -m tunelab.demo.data", description=main.__doc__)
    ap.add_argument("kind", choices=["extraction", "classification", "format"])
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--n", type=int, default=400, help="examples (per class for classification/format)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    writer = {
        "extraction": write_spam_extraction,
        "classification": write_spam_classification,
        "format": write_spam_format,
    }[args.kind]
    print(writer(spamassassin_path(), args.out, args.n, args.seed))


if __name__ == "__main__":
    main()
