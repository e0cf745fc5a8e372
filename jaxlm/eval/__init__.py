"""Evaluation: task accuracy by greedy decoding and a task's verifier, and the texts a
weight-space method calibrates on, and the calibration error of predicted probabilities."""

from jaxlm.eval.accuracy import AccuracyResult, heldout_accuracy, task_accuracy, task_texts
from jaxlm.eval.calibration import expected_calibration_error, full_calibration_error

__all__ = ["AccuracyResult", "expected_calibration_error", "full_calibration_error", "heldout_accuracy",
           "task_accuracy", "task_texts"]
