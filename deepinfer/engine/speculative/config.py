"""SpeculativeConfig: the `speculative=` argument of LLM / `deepinfer run --speculative`, checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deepinfer.engine.sampling_params import InvalidRequestError

METHODS = ("mtp",)
POLICIES = ("fixed", "confidence")
MAX_DRAFTS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "mtp": the checkpoint's MTP layer drafts (chained for more than one draft).
    num_drafts: drafts proposed per request and step (k). policy "fixed": every request verifies
    all k (vLLM's and SGLang's behaviour); "confidence": each step, each request verifies only the
    drafts that pay for themselves at the current load (deepinfer.engine.speculative.policy).
    cost_model: the confidence policy's step times, {tokens in the step: seconds, ...} with
    "draft": seconds of one draft forward per request (None: measured on the device at start-up)."""

    method: str = "mtp"
    num_drafts: int = 3
    policy: str = "fixed"
    cost_model: dict | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict, a JSON object string, or the short form
        "mtp[:k[:policy]]" (e.g. "mtp:5:confidence")."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except ValueError as exc:
                    raise InvalidRequestError(f"speculative: {text!r} is not valid JSON ({exc})") from None
            else:
                parts = text.split(":")
                if len(parts) > 3:
                    raise InvalidRequestError(f"speculative: {text!r} is not METHOD[:NUM_DRAFTS[:POLICY]], e.g. mtp:5:confidence")
                value = {"method": parts[0]}
                if len(parts) > 1:
                    try:
                        value["num_drafts"] = int(parts[1])
                    except ValueError:
                        raise InvalidRequestError(f"speculative: num_drafts {parts[1]!r} is not an integer (e.g. mtp:5:confidence)") from None
                if len(parts) > 2:
                    value["policy"] = parts[2]
        if not isinstance(value, dict):
            raise InvalidRequestError(f"speculative must be a dict such as {{'method': 'mtp', 'num_drafts': 3}}, got {type(value).__name__}")
        unknown = sorted(set(value) - {"method", "num_drafts", "policy", "cost_model"})
        if unknown:
            raise InvalidRequestError(f"speculative: unknown key {unknown[0]!r}; the keys are method, num_drafts, policy, cost_model")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_drafts
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFTS:
            raise InvalidRequestError(f"speculative: num_drafts must be an integer in [1, {MAX_DRAFTS}], got {k!r}")
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"speculative: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cost_model is not None:
            if self.policy != "confidence":
                raise InvalidRequestError("speculative: cost_model is for policy 'confidence' only")
            self.step_costs()

    def step_costs(self) -> tuple[dict[int, float], float]:
        """cost_model as ({tokens: seconds}, draft seconds per request), checked."""
        table = dict(self.cost_model or {})
        draft = table.pop("draft", 0.0)
        try:
            costs = {int(t): float(s) for t, s in table.items()}
            draft = float(draft)
        except (TypeError, ValueError):
            raise InvalidRequestError("speculative: cost_model maps token counts to seconds, e.g. {\"1\": 0.01, \"64\": 0.02, \"draft\": 0.001}") from None
        if not costs or any(t < 1 or not s > 0 for t, s in costs.items()) or draft < 0:
            raise InvalidRequestError("speculative: cost_model needs token counts >= 1 with times > 0 (and a draft time >= 0)")
        return costs, draft
