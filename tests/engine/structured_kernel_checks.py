"""Structured output through a backend's Triton kernels (tests/cuda, tests/ascend): the tokens and
finish reasons of a JSON-schema request, a date regex and a free request in one batch equal the
reference backend's, and the outputs validate (engine.structured_small_vocab's checkpoint)."""

from __future__ import annotations

import json
import re

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": False}
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def check_structured_through(backend: str, tmp_path, **llm_options) -> None:
    import jsonschema

    from deepinfer import LLM, SamplingParams

    from engine.structured_small_vocab import write_structured_checkpoint

    model = str(write_structured_checkpoint(tmp_path / "structured-small-vocab"))
    params = [
        SamplingParams(max_tokens=12, seed=1, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
        SamplingParams(max_tokens=12, seed=2, temperature=0.0, structured_outputs={"regex": DATE}),
        SamplingParams(max_tokens=3, seed=3, ignore_eos=True),
    ]
    prompts = ["Answer:", "Date:", "Free:"]
    runs = {}
    for name, options in (("reference", {}), (backend, {"interpret": True, **llm_options})):
        llm = LLM(model=model, backend=name, announce=False, **options)
        assert llm.backend == name
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[backend] == runs["reference"]
    (_, schema_end, schema_text), (_, date_end, date_text), (free_ids, free_end, _) = runs[backend]
    assert schema_end == "stop" and date_end == "stop" and free_end == "length" and len(free_ids) == 3
    jsonschema.validate(json.loads(schema_text), SCHEMA)
    assert re.fullmatch(DATE, date_text), date_text
