"""Evaluation: task accuracy by greedy decoding and a task's verifier, pass@k from samples, the
texts a weight-space method calibrates on; judging from verdict-token probabilities, calibration and
selective-prediction metrics, post-hoc recalibration and conformal acceptance thresholds; the
exact paired sign test for two systems scored on the same items."""

from jaxlm.eval.accuracy import AccuracyResult, heldout_accuracy, task_accuracy, task_texts
from jaxlm.eval.calibration import (adaptive_calibration_error, calibration_report, expected_calibration_error,
                                    full_calibration_error, rms_calibration_error, signed_calibration_error)
from jaxlm.eval.conformal import (bidirectional_preference, ltt_threshold, preference_entropy, scope_threshold,
                                  selective_report)
from jaxlm.eval.judge import JudgeTemplate, judge_pairs, judge_points
from jaxlm.eval.paired import PairedComparison, paired_comparison, sign_test_p
from jaxlm.eval.pass_at_k import PassAtKResult, heldout_pass_at_k, pass_at_k
from jaxlm.eval.recalibration import fit_isotonic, fit_platt
from jaxlm.eval.scoring import candidate_logprobs
from jaxlm.eval.selective import aurc, auroc, risk_coverage, selective_accuracy

__all__ = [
    "AccuracyResult", "JudgeTemplate", "PairedComparison", "PassAtKResult", "adaptive_calibration_error", "aurc", "auroc", "bidirectional_preference",
    "calibration_report", "candidate_logprobs", "expected_calibration_error", "fit_isotonic", "fit_platt",
    "full_calibration_error", "heldout_accuracy", "heldout_pass_at_k", "judge_pairs", "judge_points", "ltt_threshold",
    "paired_comparison", "pass_at_k",
    "preference_entropy", "risk_coverage", "rms_calibration_error", "scope_threshold", "selective_accuracy",
    "selective_report", "sign_test_p", "signed_calibration_error", "task_accuracy", "task_texts",
]
