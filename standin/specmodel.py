"""The stand-in's decode speed and speculative-decoding model.

Small, deterministic given a seed, and calibrated to the seed's single-stream measurements
(Kimi-K2.5 on 8 GPUs: 90 tok/s without speculation; EAGLE-3 with accept length about 2.1-2.3).

Times are per decode *cycle* at batch size b (one forward without speculation; draft steps +
verify + draft-extend with it):

    target(b)  = T_TARGET_S * (1 + BATCH_COST * (b - 1))
    plain      = target(b)                                   (+ LAUNCH_S without CUDA graphs)
    spec       = steps * T_DRAFT_S * (1 + BATCH_COST*(b-1))
                 + target(b) * (1 + VERIFY_PER_TOKEN * b * (draft_tokens - 1))
                 + T_SPEC_OVERHEAD_S
                 (+ LAUNCH_S * (steps + 2) without CUDA graphs: one per forward)

Accept length (tokens per cycle, the bonus token included) follows a depth-wise chain: each of
the `steps` draft depths is accepted with probability q(w) given that the previous one was,

    q(w) = P_ACCEPT + (1 - P_ACCEPT) * (1 - (1 - P_EXTRA) ** (w - 1)),
    w    = max(1, min(topk, (draft_tokens - 1) // steps))   candidates per depth,

so the expected accept length is 1 + q + q^2 + ... + q^steps. Extra candidates per depth help
little (P_EXTRA is small): the seed's drafter was weak, and 16 draft tokens bought only a few
tenths of accept length over 5.

Per stream the rate is accept_len / cycle(b); in total it is b times that. With BATCH_COST 0.03
the per-stream rate falls about 3 % per extra concurrent stream while the total keeps rising.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

T_TARGET_S = 1 / 90  # one target forward at batch 1 with CUDA graphs: the 90 tok/s baseline
T_DRAFT_S = 0.0035  # one draft step
T_SPEC_OVERHEAD_S = 0.002  # draft-extend and tree bookkeeping per cycle
VERIFY_PER_TOKEN = 0.0426  # extra verify cost per draft token, as a fraction of a forward
LAUNCH_S = 0.0025  # kernel-launch overhead per forward without CUDA graphs
BATCH_COST = 0.03  # extra cost per additional sequence in the batch
P_ACCEPT = 0.575  # acceptance of a depth with one candidate
P_EXTRA = 0.05  # extra acceptance from each additional candidate at a depth

# SGLang's auto_choose_speculative_params for most models (SGLANG.md §1).
AUTO_SPEC_PARAMS = (5, 4, 8)


@dataclass(frozen=True)
class SpecParams:
    steps: int
    topk: int
    draft_tokens: int


@dataclass(frozen=True)
class DecodeModel:
    spec: SpecParams | None
    cuda_graph: bool = True

    def cycle_s(self, batch: int = 1) -> float:
        batch = max(1, batch)
        scale = 1 + BATCH_COST * (batch - 1)
        target = T_TARGET_S * scale
        if self.spec is None:
            return target + (0.0 if self.cuda_graph else LAUNCH_S)
        s = self.spec
        t = (
            s.steps * T_DRAFT_S * scale
            + target * (1 + VERIFY_PER_TOKEN * batch * (s.draft_tokens - 1))
            + T_SPEC_OVERHEAD_S
        )
        if not self.cuda_graph:
            t += LAUNCH_S * (s.steps + 2)
        return t

    def depth_acceptance(self) -> float:
        if self.spec is None:
            return 0.0
        s = self.spec
        width = max(1, min(s.topk, (s.draft_tokens - 1) // max(1, s.steps)))
        return P_ACCEPT + (1 - P_ACCEPT) * (1 - (1 - P_EXTRA) ** (width - 1))

    def expected_accept_len(self) -> float:
        if self.spec is None:
            return 1.0
        q = self.depth_acceptance()
        return 1 + sum(q**i for i in range(1, self.spec.steps + 1))

    def expected_tok_s(self, batch: int = 1) -> float:
        """Tokens per second per stream."""
        return self.expected_accept_len() / self.cycle_s(batch)

    def sample_accepted(self, rng: random.Random) -> int:
        """Tokens one cycle yields for one sequence (the bonus token included)."""
        if self.spec is None:
            return 1
        q = self.depth_acceptance()
        n = 1
        for _ in range(self.spec.steps):
            if rng.random() >= q:
                break
            n += 1
        return n


def resolve_spec_params(
    algorithm: str | None,
    steps: int | None,
    topk: int | None,
    draft_tokens: int | None,
    warn: list[str] | None = None,
) -> SpecParams | None:
    """SGLang's rules: all unset -> auto (5, 4, 8); some set -> assert; topk 1 -> steps + 1."""
    if not algorithm or algorithm.upper() not in ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE"):
        return None
    if steps is None:
        if topk is not None or draft_tokens is not None:
            raise AssertionError  # SGLang's bare `assert`: no message
        steps, topk, draft_tokens = AUTO_SPEC_PARAMS
    if topk is None:
        raise TypeError("'>' not supported between instances of 'NoneType' and 'int'")
    if topk == 1 and draft_tokens != steps + 1:
        if warn is not None:
            warn.append(
                "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
                "when speculative_eagle_topk == 1"
            )
        draft_tokens = steps + 1
    if draft_tokens is None:
        draft_tokens = steps + 1
    return SpecParams(steps=steps, topk=topk, draft_tokens=draft_tokens)
