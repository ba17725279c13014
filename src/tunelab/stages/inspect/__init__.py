"""Stage 3, inspect: examples after the exact preprocessing of training (text and images); stops on a broken mask."""
