"""Stage 2b: inter-slice calibration — slice durations merged into one globally consistent timeline."""

from prism_core.calibrate.predict import Prediction, predict, prediction_metrics
from prism_core.calibrate.timeline import CalibrationError

__all__ = ["CalibrationError", "Prediction", "predict", "prediction_metrics"]
