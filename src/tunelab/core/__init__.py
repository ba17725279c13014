"""The study folder and its evidence: config, errors, records, ledger, environment, hub. Never imports torch at import time."""
