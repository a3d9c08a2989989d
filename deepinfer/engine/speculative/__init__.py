"""Speculative decoding: draft a few tokens per request cheaply, verify them in one target forward.

    config.py            what the user asks for: LLM(speculative={"method": "mtp", "num_drafts": k, "policy": ...})
    mtp_drafter.py       the drafts: the checkpoint's MTP layer, chained, with its own paged cache
    controlled_draft.py  a draft source that agrees with a known continuation at a chosen rate (benchmarks, tests)
    policy.py            how many drafts each request verifies this step: fixed k, or confidence-driven
    acceptance.py        the confidence policy's per-draft acceptance probabilities, calibrated online
    cost_model.py        step time by tokens in the step, measured on the device at start-up
    decoder.py           one engine step with speculation: draft, choose, verify (rejection_sample), re-draft
    metrics.py           acceptance length, drafts verified per step, accepted per verified
"""
