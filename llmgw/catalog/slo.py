"""A model's `slo:` block in the catalog: the latency targets its requests get when neither their
headers nor their key set them (llmgw.slo), and the share of requests that must meet them (read and
validated; the autoscaler, workers/control/autoscale.py, does not scale on it yet).

    slo:
      ttft: 500ms        # first byte within 500 ms of arrival
      tpot: 80ms         # at most 80 ms per output token after the first
      deadline: 60s      # the whole answer within 60 s
      strict: false      # true: a request predicted to miss them is refused at once (429)
      attainment: 0.99   # the share that must meet them (read and checked; the autoscaler does not use it yet)

Durations are written with their unit (`500ms`, `0.5s`, `2s`, `5m`); published on each endpoint
(EndpointInfo.slo_ttft, slo_tpot, slo_deadline, slo_strict) for the gateways to read.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from llmgw.slo import BadDuration, Targets, parse_duration


class SloSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft: str | None = None
    tpot: str | None = None
    deadline: str | None = None
    strict: StrictBool = False
    attainment: float = Field(default=0.99, gt=0, le=1, allow_inf_nan=False)

    @field_validator("ttft", "tpot", "deadline", mode="before")
    @classmethod
    def _duration(cls, v):
        if v is None:
            return v
        try:
            parse_duration(v)
        except BadDuration as e:
            raise ValueError(str(e)) from None
        return v.strip()

    def targets(self) -> Targets:
        """The targets in seconds."""
        sec = lambda v: parse_duration(v) if v is not None else None  # noqa: E731
        return Targets(sec(self.ttft), sec(self.tpot), sec(self.deadline), self.strict)


def endpoint_fields(spec: SloSpec | None) -> dict:
    """What an endpoint of a model with `spec` publishes of it (EndpointInfo's slo_* fields)."""
    if spec is None:
        return {}
    t = spec.targets()
    return {"slo_ttft": t.ttft, "slo_tpot": t.tpot, "slo_deadline": t.deadline, "slo_strict": t.strict}
