"""The Scheduler package: continuous batching over a model worker (see ``scheduler.py``)."""

from framework.runtime.scheduler.scheduler import Scheduler
from framework.runtime.scheduler.worker import (
    ModelRunnerWorker,
    ModelWorker,
    StepResult,
    WorkerBatch,
)

__all__ = ["ModelRunnerWorker", "ModelWorker", "Scheduler", "StepResult", "WorkerBatch"]
