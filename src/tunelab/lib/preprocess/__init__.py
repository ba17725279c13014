"""Preprocessing: text (prompt templates, tokens, the loss mask) and images (the transform chain), with the problems that stop both."""
