"""Stage 9, compare: variants beside the baseline, paired statistics, guardrails judged, flips, config diffs."""
