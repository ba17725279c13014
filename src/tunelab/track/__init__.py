"""Mirrors of the study's records in the trackers users already watch: MLflow and TensorBoard.

The study folder stays the evidence; these are copies, rebuilt from it at any time.

- `flatten`: the records of a run as what a tracker takes (params, tags, metric points, files)
- `mlflow_mirror`: `sync_mlflow(study, uri)`, the study as one MLflow experiment
- `tensorboard`: `TensorBoardWriter`, event files in a run folder
- `live`: `LiveLogger`, the step metrics sent while training (`training.log_to`)
- `optional`: the `tracking` extra, imported only when used

Importing this package imports neither mlflow nor tensorboard.
"""
