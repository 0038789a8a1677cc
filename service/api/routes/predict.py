from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from oomcast.model.forecast import forecast_window
from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.responses import WITH_BODY, responses
from oomcast.service.api.samples_in import SamplesBody, parse_samples

router = APIRouter(tags=["forecast"], dependencies=[Authorized])


@router.post("/predict", responses=responses(*WITH_BODY))
def predict(body: SamplesBody, ctx: Ctx) -> dict[str, Any]:
    """Forecast one domain from its recent samples (stateless: live state is not touched)."""
    samples = parse_samples(body.samples, limit=ctx.settings.max_predict_samples, one_domain=True)
    forecast = forecast_window(ctx.detector.forecaster, samples)
    return {
        "risk": {str(h): round(p, 6) for h, p in forecast.risk.items()},
        "time_to_oom_s": forecast.time_to_oom_s,
        "model_version": forecast.model_version,
        "observed_at": forecast.observed_at,
    }
