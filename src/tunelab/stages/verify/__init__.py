"""Stage 10, verify: a checkpoint reloaded in a fresh process reproduces its recorded predictions."""
