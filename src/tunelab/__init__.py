"""tunelab: fine-tuning experiments run as a careful protocol, with the evidence kept."""

__version__ = "0.1.0"
