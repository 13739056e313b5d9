"""The planner: analytic performance model and pipeline simulator (imports no runtime)."""

from pipeserve.plan.analysis import PlanEstimate, PlanRequest, evaluate
from pipeserve.plan.hardware import HARDWARE_PRESETS, Hardware, load_hardware
from pipeserve.plan.predict import predict_throughput, simulate
from pipeserve.plan.presets import MODEL_PRESETS, PlanInputError, load_model
from pipeserve.plan.workload import Workload

__all__ = ["HARDWARE_PRESETS", "MODEL_PRESETS", "Hardware", "PlanEstimate", "PlanInputError",
           "PlanRequest", "Workload", "evaluate", "load_hardware", "load_model",
           "predict_throughput", "simulate"]
