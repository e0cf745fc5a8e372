"""Evaluation: task accuracy by greedy decoding and a task's verifier, and the texts a
weight-space method calibrates on."""

from jaxlm.eval.accuracy import AccuracyResult, heldout_accuracy, task_accuracy, task_texts

__all__ = ["AccuracyResult", "heldout_accuracy", "task_accuracy", "task_texts"]
