"""Inference for evaluation: batched greedy generation, the in-place KV-cache decoder, and the evaluation copy (merged, packed)."""
