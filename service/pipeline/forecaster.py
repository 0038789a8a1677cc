"""Which forecaster the service runs: the trained model, or a baseline, said loudly.

``OOMCAST_FORECASTER=model`` (the default) loads the ONNX model (``OOMCAST_MODEL_PATH``,
else the one shipped in the package). A model the operator named that cannot be loaded
stops the service at start-up: a typo in the path must not quietly start a baseline. If the
shipped model cannot be loaded (onnxruntime missing), the service still starts, forecasting
with a baseline, and says so in its log, ``/readyz`` and ``/metrics``: a forecaster that is
worse than expected must never be mistaken for the real one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from oomcast.model.baselines import baseline_by_name, baseline_detectors
from oomcast.model.forecast import Detector
from oomcast.service.pipeline.outcomes import CHAMPION, SHADOW, Scored
from oomcast.service.pipeline.rules import AlertPolicy, policy_rule
from oomcast.service.settings import Settings

log = logging.getLogger("oomcast.service")
FALLBACK = "predict_linear_w60s_h60s_gate0.80_full"


@dataclass
class Choice:
    detector: Detector
    kind: str  # "model", "baseline" (asked for) or "fallback" (model unavailable)
    reason: str
    provider: str


def choose(settings: Settings) -> Choice:
    if settings.forecaster != "model":
        det = baseline_by_name(settings.forecaster)
        log.warning("forecasting with the BASELINE %s, as configured", det.forecaster.version)
        return Choice(det, "baseline", "OOMCAST_FORECASTER names a baseline", "python")
    try:
        from oomcast.model.runtime import DEFAULT_MODEL, ModelLoadError, OnnxForecaster
    except ImportError as exc:  # numpy present, onnxruntime not: ModelLoadError covers it
        return _fallback(f"cannot import the runtime: {exc}")
    path = settings.model_path or str(DEFAULT_MODEL)
    try:
        fc = OnnxForecaster(path)
    except ModelLoadError as exc:
        if settings.model_path:  # the operator named a model: a typo must not start a baseline
            raise ModelLoadError(f"OOMCAST_MODEL_PATH={settings.model_path}: {exc}") from None
        return _fallback(str(exc))
    log.info("forecasting with model %s from %s on %s", fc.version, path, fc.provider)
    return Choice(Detector("model", fc, fc.rule), "model", f"loaded {path}", fc.provider)


def _fallback(reason: str) -> Choice:
    det = baseline_by_name(FALLBACK)
    log.error(
        "MODEL NOT LOADED (%s): forecasting with the BASELINE %s instead; alerts will come"
        " later and more often wrong than the model's",
        reason,
        det.forecaster.version,
    )
    return Choice(det, "fallback", reason, "python")


def alert_policy(settings: Settings, choice: Choice) -> AlertPolicy:
    """The rule from the settings; for the model, its own validated rule unless the
    operator set one (OOMCAST_ALERT_HORIZON_S / OOMCAST_ALERT_FIRE_RISK)."""
    chosen = settings.model_fields_set
    horizon, fire = settings.alert_horizon_s, settings.alert_fire_risk
    fire_after, resolve = settings.alert_fire_after, settings.alert_resolve_risk
    if choice.kind == "model" and not {"alert_horizon_s", "alert_fire_risk"} & chosen:
        horizon, fire = choice.detector.rule.horizon_s, choice.detector.rule.fire_risk
        if "alert_fire_after" not in chosen:
            fire_after = choice.detector.rule.fire_after  # as validated
        if "alert_resolve_risk" not in chosen:
            resolve = round(fire / 2, 4)
    return AlertPolicy(
        horizon,
        fire,
        resolve,
        fire_after,
        settings.alert_resolve_after,
        settings.alert_resolve_after_s,
    )


def choose_shadow(settings: Settings) -> Detector | None:
    """The shadow model ``OOMCAST_SHADOW_MODEL_PATH`` names (an ONNX model, or a baseline by
    name), or None. One that cannot be loaded stops the service at start-up, as a named
    champion does: a challenger that silently is not there would score nothing."""
    name = settings.shadow_model_path
    if not name:
        return None
    det, kind, _ = load_named(name, "OOMCAST_SHADOW_MODEL_PATH")
    log.info(
        "shadow: %s %s from %s, scored beside the champion", kind, det.forecaster.version, name
    )
    return Detector("shadow", det.forecaster, det.rule)


def is_baseline(name: str) -> bool:
    """Whether ``name`` is a baseline's name or version (threshold_0.90,
    baseline/threshold_0.90)."""
    return any(name in (d.name, str(d.forecaster.version)) for d in baseline_detectors())


def load_named(name: str, what: str) -> tuple[Detector, str, str]:
    """The forecaster ``name`` names: a baseline (by name or version) or an ONNX model's
    path; with its kind ("baseline" or "model") and provider. An error naming ``what`` (the
    setting or field that gave the name) when it cannot be loaded."""
    if is_baseline(name):  # threshold_0.90, or baseline/threshold_0.90
        return baseline_by_name(name), "baseline", "python"
    baselines = [d.name for d in baseline_detectors()]
    try:
        from oomcast.model.runtime import ModelLoadError, OnnxForecaster
    except ImportError as exc:
        raise RuntimeError(f"{what}={name}: no ONNX runtime ({exc})") from None
    try:
        fc = OnnxForecaster(name)
    except ModelLoadError as exc:
        raise ModelLoadError(
            f"{what}={name}: {exc} (an ONNX model's path, or one of the"
            f" baselines: {', '.join(baselines)})"
        ) from None
    return Detector("model", fc, fc.rule), "model", fc.provider


def shadow_policy(settings: Settings, shadow: Detector) -> AlertPolicy:
    """The shadow's own validated rule: it is scored as it would alert if it acted."""
    rule = shadow.rule
    return AlertPolicy(
        rule.horizon_s,
        rule.fire_risk,
        round(rule.fire_risk / 2, 4),
        rule.fire_after,
        settings.alert_resolve_after,
        settings.alert_resolve_after_s,
    )


def scored_models(settings: Settings, policy: AlertPolicy, shadow: Detector | None) -> list[Scored]:
    """Who the scorecard scores: the champion by the rule it acts with, and a shadow model
    (if any) by its own validated rule, on a forecaster state of its own."""
    if not settings.outcomes:
        return []
    out = [Scored(CHAMPION, policy_rule(policy, name="scored"))]
    if shadow is not None:
        rule = policy_rule(shadow_policy(settings, shadow), name="scored-shadow")
        out.append(Scored(SHADOW, rule, shadow.forecaster))
    return out
