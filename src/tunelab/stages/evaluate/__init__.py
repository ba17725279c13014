"""Stages 4 and 8, baseline and evaluate: one evaluation procedure for the untouched model and every variant."""
