"""One package per protocol stage; each has a `stage` module holding what its command runs."""
