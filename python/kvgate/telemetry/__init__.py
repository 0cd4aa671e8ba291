"""Engine telemetry: engine-metrics adapters (:mod:`.engine_metrics`) and the per-backend
metrics poller (:mod:`.poller`). Nothing here imports the rest of kvgate."""
