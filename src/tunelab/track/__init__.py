"""Mirrors of the study's records in the trackers users already watch: MLflow, W&B, Trackio
and TensorBoard.

The study folder stays the evidence; these are copies, rebuilt from it at any time.

- `flatten`: the records of a run as what a tracker takes (params, tags, metric points, files)
- `mlflow_mirror`: `sync_mlflow(study, uri)`, the study as one MLflow experiment
- `wandb_mirror`: `sync_wandb(study, ...)`, one W&B run per tunelab run (offline run folders)
- `trackio_mirror`: `sync_trackio(study, ...)`, the study as a project of Trackio's local store
- `tensorboard`: `TensorBoardWriter`, event files in a run folder
- `live`: `LiveLogger`, the step metrics sent while training (`training.log_to`)
- `optional`: the `tracking` extra, imported only when used

Importing this package imports none of mlflow, tensorboard, wandb and trackio.
"""
