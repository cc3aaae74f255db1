"""The accept step on the device: verify each row's drafts against the target model's own tokens.

A verifying row computed its last token and its drafts d1..dk in one chunk, so the model gave logits at
k + 1 positions. The target's token at each position is drawn exactly as a plain decode step would draw
it there — the sampler at the request's step counter (counter-based noise: sampler.py) — and the row
keeps the longest prefix of drafts equal to those tokens, plus the target's token after it (the bonus).

Greedy: the longest prefix matching the target's argmax, plus the bonus. Sampling: for a draft that is
one token with probability 1 (n-gram), rejection sampling accepts d with probability min(1, p(d)/1) = p(d)
and on rejection draws from p with d removed, renormalised. Drawing t ~ p and accepting d iff t = d does
exactly that (P(accept) = p(d); given t != d, t is distributed as the residual), and it draws the same
tokens a run without speculation draws, so a seeded request's tokens do not change.

The chunk's first token is the request's last token as the device holds it (the engine writes it from
decoder state), so the check is exact even when the host proposed the drafts before reading that token
(overlap: speculation.propose_drafts).

Stop ids and max_new_tokens apply token by token: the row keeps tokens up to and including the first
stop id, and never more than the request may still generate. Pure tensor code: no host sync.
"""

from __future__ import annotations

import torch

from strategies.runtime.decoder.sampler import sample


@torch.jit.script
def accept_drafts(logits: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                  out: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, last_token: torch.Tensor, gen_len: torch.Tensor,
                  max_new: torch.Tensor, stop_ids: torch.Tensor, finished: torch.Tensor, use_filters: bool,
                  any_random: bool) -> None:
    """logits [R * (K + 1), V]: row i's positions at i * (K + 1) + j (past its drafts, repeats of its last);
    drafts [R, K], num_drafts [R]; writes out [R, K + 4]: the K + 1 target tokens, how many the request
    received, the finish code, and how many of its drafts it received."""
    r, k = drafts.size(0), drafts.size(1)
    k1 = k + 1
    rows = slots.unsqueeze(1).expand(r, k1).reshape(-1)  # [R * (K + 1)] each position's slot
    g = gen_len[slots]  # [R] tokens generated before this step
    steps = (g.unsqueeze(1) + torch.arange(k1, device=slots.device).unsqueeze(0)).flatten()  # [R * (K + 1)]
    target = sample(logits[:r * k1], temperature[rows], top_k[rows], top_p[rows], min_p[rows], seed[rows], steps,
                    use_filters, any_random).view(r, k1)  # [R, K + 1]
    j = torch.arange(k, device=slots.device).unsqueeze(0)  # [1, K]
    match = (drafts == target[:, :k]) & (j < num_drafts.unsqueeze(1))  # [R, K]
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [R] leading drafts the target agrees with
    pos = torch.arange(k1, device=slots.device).unsqueeze(0)  # [1, K + 1]
    candidate = pos <= accepted.unsqueeze(1)  # [R, K + 1] accepted drafts' tokens and the bonus
    is_stop = (stop_ids[slots].unsqueeze(1) == target.unsqueeze(2)).any(dim=2) & candidate  # [R, K + 1]
    first_stop = torch.where(is_stop.any(dim=1), is_stop.long().argmax(dim=1), torch.full_like(accepted, k1))  # [R]
    active = ~finished[slots]  # [R]
    n = torch.minimum(torch.minimum(accepted + 1, first_stop + 1), max_new[slots] - g)  # [R]
    n = torch.where(active, n, torch.zeros_like(n))
    hit_stop = active & (first_stop < n)  # [R]
    new_len = g + n  # [R]
    hit_len = active & ~hit_stop & (new_len >= max_new[slots])  # [R]
    last = target.gather(1, (n - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # [R]
    last_token[slots, 0] = torch.where(active, last, last_token[slots, 0])
    gen_len[slots] = new_len
    finished[slots] = finished[slots] | hit_stop | hit_len
    code = hit_stop.long() + hit_len.long() * 2  # STOP 1 / LENGTH 2 / CONTINUE 0
    out[:r, :k1] = target
    out[:r, k1] = n
    out[:r, k1 + 1] = torch.where(active, code, torch.full_like(code, -1))
    out[:r, k1 + 2] = torch.minimum(accepted, (n - 1).clamp(min=0))
