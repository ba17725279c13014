"""What the stages share: models, tasks, preprocessing, inference, metrics and the planner's probes."""
