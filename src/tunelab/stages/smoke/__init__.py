"""Stage 5, smoke: a few examples through the whole training and evaluation loop, then a reload."""
