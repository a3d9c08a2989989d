"""Speculative decoding's counters and the figures users compare (vLLM's names where it has them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeMetrics:
    steps: int = 0  # decode steps that verified
    verifications: int = 0  # (request, step) pairs: each yields its accepted drafts + 1 token
    drafts_proposed: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0

    def record(self, proposed: int, verified: int, accepted: int) -> None:
        self.verifications += 1
        self.drafts_proposed += proposed
        self.drafts_verified += verified
        self.drafts_accepted += accepted

    def summary(self) -> dict[str, float]:
        """acceptance_length: tokens a request gains per verification (accepted drafts + 1);
        drafts_verified_per_step: drafts a request verifies per step; accepted_per_verified:
        the share of verified drafts accepted."""
        n = max(self.verifications, 1)
        return {
            "acceptance_length": (self.drafts_accepted + self.verifications) / n,
            "drafts_verified_per_step": self.drafts_verified / n,
            "accepted_per_verified": self.drafts_accepted / max(self.drafts_verified, 1),
            "drafts_proposed_per_step": self.drafts_proposed / n,
            "verify_steps": self.steps,
            "verifications": self.verifications,
        }
