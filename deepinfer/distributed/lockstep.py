"""One rank's part of an expert-parallel step, as its ranks agreed on it (distributed.step_agreement).

An engine's decode steps can replay device graphs with expert parallelism only where the chosen
dispatch and combine kernels need no host synchronisation given a token bound
(`ep_decode_capturable`). Then the ranks must hold the same graphs, captured in the same steps (the
warm-up forwards run the MoE collectives), and replay the same one in a step. `LockstepRunner`
runs what the agreement decided, on one rank:

- a graph size not captured yet is captured first, by every rank in the same step;
- the engine's step bookkeeping runs (`before_step`: an EPLB rebalance when one is due, a collective);
- the dispatches of a graph step get the graph's batch as their token bound; an eager step gets none
  (each dispatch exchanges the token counts);
- a rank without requests still joins the MoE collectives: an empty forward, or in a graph step the
  graph's padding rows only.
"""

from __future__ import annotations

import logging

from deepinfer.distributed.expert_parallel import token_bound
from deepinfer.distributed.step_agreement import RankStep

log = logging.getLogger(__name__)


def ep_decode_capturable(ops, model, max_num_seqs: int) -> bool:
    """Whether expert-parallel decode steps can be captured: the chosen dispatch and combine kernels
    declare that they need no host synchronisation given a token bound (their registration's
    `capturable_with_token_bound(ranks, bound, top_k)`) at the largest graph's batch."""
    from deepinfer.engine.decode_graphs import batch_buckets

    checks = [k.capturable_with_token_bound if k is not None else None for k in map(ops.registration, ("dispatch", "combine"))]
    groups = getattr(model, "expert_parallels", [])
    if None in checks or not groups:
        return False
    bound = batch_buckets(max_num_seqs)[-1]  # the largest graph's batch
    top_k = model.config.num_experts_per_tok
    if not all(capturable(groups[0].size, bound, top_k) for capturable in checks):
        log.info("expert parallelism: decode steps run without device graphs (the %s-rank exchange of %d tokens x top-%d "
                 "needs a host synchronisation; a smaller max_num_seqs allows graphs)", groups[0].size, bound, top_k)
        return False
    return True


class LockstepRunner:
    """Runs one engine's steps in lockstep with the other ranks of its expert-parallel group. From
    now on the engine's device graphs are captured only here, by all ranks together."""

    def __init__(self, engine):
        self.engine = engine
        self.graphs = engine.runner.graphs
        self.graph_sizes: list[int] = self.graphs.buckets if self.graphs is not None else []
        if self.graphs is not None:
            self.graphs.collective = True  # no capture on demand by one rank

    def propose(self, batch, num_finished: int, prompt_tokens: int, generated_tokens: int) -> RankStep:
        """What this rank brings to the step's agreement: its scheduled batch (None: idle), its
        results not gathered yet, its token counts since the run started."""
        replayable = batch is None or self.engine.runner.replayable(batch)
        bucket = None
        if batch is not None and replayable and self.graph_sizes:
            bucket = self.graph_sizes.index(self.graphs.bucket(len(batch.seqs)))
        return RankStep(batch is not None, num_finished, replayable, bucket, prompt_tokens, generated_tokens, self.engine.has_unfinished())

    def run(self, batch, graph_size: int) -> list:
        """Run this rank's part of the agreed step: its batch (None: an idle step) as the graph of
        `graph_size` on every rank, or eagerly (0). Returns the sequences that finished."""
        engine = self.engine
        if graph_size:
            with self._bound(graph_size):
                self.graphs.capture(graph_size)  # a no-op once captured; new graphs pair up across the ranks
        engine.before_step()
        with self._bound(graph_size):
            if batch is not None:
                return engine.execute(batch, graph_size)
            if graph_size:
                self.graphs.run_padding(graph_size)
            else:
                engine.runner.run_idle()
        return []

    def _bound(self, graph_size: int):
        """The token bound of this step's dispatches: the graph's batch in a graph step, else none."""
        return token_bound(getattr(self.engine.loaded.model, "expert_parallels", []), graph_size or None)
