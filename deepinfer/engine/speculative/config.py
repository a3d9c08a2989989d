"""SpeculativeConfig: the `speculative=` argument of LLM / `deepinfer run --speculative`, checked."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from deepinfer.engine.sampling_params import InvalidRequestError

METHODS = ("mtp", "dspark")
POLICIES = ("fixed", "confidence", "head")
NOT_GIVEN = object()  # a field the user left out: the method's default (an explicit None is checked like any value)
DEFAULTS = {"mtp": (3, "fixed"), "dspark": (None, "head")}  # method -> (num_drafts, policy) when not given; None: the block size
MAX_DRAFTS = 16
KEYS = ("method", "num_drafts", "policy", "cost_model")
MEASURE = "measure"  # cost_model: measure the step costs now, replacing this machine's cached fit
COST_MODEL_FORM = '{"1": 0.01, "64": 0.02, "draft": 0.001}'


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "mtp": the checkpoint's MTP layer drafts (chained for more than one draft), DeepSeek V2/V3/V4;
    "dspark": DeepSeek-V4.1's DSpark blocks draft a block of tokens at once, with a confidence head.
    num_drafts: drafts proposed per request and step (k; mtp: 3 unless given; dspark: the checkpoint's
    block size unless given, at most that). policy "fixed": every request verifies all k (vLLM's and
    SGLang's behaviour); "confidence": each step, each request verifies only the drafts that pay for
    themselves at the current load, their acceptance calibrated online (deepinfer.engine.speculative.policy);
    "head" (dspark's default): likewise, reading the draft's confidences as acceptance probabilities
    (DSpark's confidence head is trained to be one: deepinfer.engine.speculative.head_policy).
    cost_model: the confidence policy's step times, {tokens in the step: seconds, ...} with
    "draft": seconds of one draft forward per request; None: this machine's fit for the model's
    shape, measured on the device the first time and cached (deepinfer.engine.speculative.cost_cache);
    "measure": measured again now, replacing the cached fit."""

    method: str = "mtp"
    num_drafts: int | None = NOT_GIVEN  # type: ignore[assignment]
    policy: str = NOT_GIVEN  # type: ignore[assignment]
    cost_model: dict | str | None = field(default=None, compare=False)

    def __post_init__(self):
        drafts, policy = DEFAULTS.get(self.method, (3, "fixed")) if isinstance(self.method, str) else (3, "fixed")  # an unknown one fails in validate()
        if self.num_drafts is NOT_GIVEN:
            object.__setattr__(self, "num_drafts", drafts)
        if self.policy is NOT_GIVEN:
            object.__setattr__(self, "policy", policy)

    def with_block_size(self, block_size: int) -> "SpeculativeConfig":
        """dspark on a checkpoint whose DSpark block drafts `block_size` tokens: num_drafts resolved (the block
        size when not given); more than the block holds is a one-line error."""
        if self.num_drafts is None:
            return dataclasses.replace(self, num_drafts=block_size)
        if self.num_drafts > block_size:
            raise InvalidRequestError(f"speculative: dspark drafts at most the checkpoint's block of {block_size} tokens, num_drafts is {self.num_drafts}")
        return self

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict, a JSON object string, or the short form
        "METHOD[:k[:policy]]" (e.g. "mtp:5:confidence", "dspark", "dspark:3:fixed")."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for the decoder
                    reason = exc if isinstance(exc, ValueError) else "nested too deep"
                    raise InvalidRequestError(f"speculative: {_shown(text)} is not valid JSON ({reason})") from None
            else:
                parts = text.split(":")
                if len(parts) > 3:
                    raise InvalidRequestError(f"speculative: {_shown(text)} is not METHOD[:NUM_DRAFTS[:POLICY]], e.g. mtp:5:confidence")
                value = {"method": parts[0]}
                if len(parts) > 1:
                    try:
                        value["num_drafts"] = int(parts[1])
                    except ValueError:
                        raise InvalidRequestError(f"speculative: num_drafts {_shown(parts[1])} is not an integer (e.g. mtp:5:confidence)") from None
                if len(parts) > 2:
                    value["policy"] = parts[2]
        if not isinstance(value, dict):
            raise InvalidRequestError(f"speculative must be a dict such as {{'method': 'mtp', 'num_drafts': 3}}, got {type(value).__name__}")
        unknown = sorted((key for key in value if key not in KEYS), key=repr)  # keys of any type (a dict from Python)
        if unknown:
            raise InvalidRequestError(f"speculative: unknown key {_shown(unknown[0])}; the keys are {', '.join(KEYS)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise InvalidRequestError(f"speculative: method must be one of {', '.join(METHODS)}, got {_shown(self.method)}")
        k = self.num_drafts
        if k is None and self.method == "dspark":
            pass  # the block size, once the checkpoint is known (with_block_size)
        elif not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFTS:
            raise InvalidRequestError(f"speculative: num_drafts must be an integer in [1, {MAX_DRAFTS}], got {_shown(k)}")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise InvalidRequestError(f"speculative: policy must be one of {', '.join(POLICIES)}, got {_shown(self.policy)}")
        if self.cost_model is not None:
            if self.policy not in ("confidence", "head"):
                raise InvalidRequestError("speculative: cost_model is for policies 'confidence' and 'head' only")
            if not self.remeasure:
                self.step_costs()

    @property
    def remeasure(self) -> bool:
        """cost_model "measure": measure the step costs now, whatever this machine has cached."""
        return isinstance(self.cost_model, str) and self.cost_model == MEASURE

    def step_costs(self) -> tuple[dict[int, float], float]:
        """cost_model as ({tokens: seconds}, draft seconds per request), checked."""
        if not isinstance(self.cost_model, dict):
            raise InvalidRequestError(f"speculative: cost_model must be {COST_MODEL_FORM} or {MEASURE!r} (measure it again now), got {_shown(self.cost_model)}")
        table = dict(self.cost_model)
        draft = table.pop("draft", 0.0)
        costs = {}
        for tokens, seconds in table.items():
            count = _token_count(tokens)
            if count is None or not _seconds(seconds) or seconds <= 0:
                raise InvalidRequestError(
                    f"speculative: cost_model entry {_shown(tokens)}: {_shown(seconds)} must map a token count >= 1 to seconds > 0, e.g. {COST_MODEL_FORM}"
                )
            costs[count] = float(seconds)
        if not costs:
            raise InvalidRequestError(f"speculative: cost_model needs at least one token count, e.g. {COST_MODEL_FORM}")
        if not _seconds(draft) or draft < 0:
            raise InvalidRequestError(f"speculative: cost_model's draft time must be seconds >= 0, got {_shown(draft)}")
        return costs, float(draft)


def _token_count(key) -> int | None:
    """A cost_model key as a token count >= 1 (JSON keys are strings of digits), else None."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 1 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
        return int(key) if int(key) >= 1 else None
    return None


def _seconds(value) -> bool:
    """A finite number (no bool, no string, no NaN or infinity: JSON's NaN / Infinity parse as floats)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value, most: int = 60) -> str:
    """A value for a one-line message: its repr, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 5]}...{text[-2:]}"
