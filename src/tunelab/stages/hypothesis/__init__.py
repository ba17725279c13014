"""Stage 1, hypothesis: the locked hypothesis, guardrails and evaluation spec; hub refs pinned; `tunelab init`'s template."""
