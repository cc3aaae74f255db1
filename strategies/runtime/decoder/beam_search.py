"""One beam-search step on the device, with Hugging Face ``generate``'s semantics, as pure tensor code.

For R requests of beam width K (one group of a step's rows; a step runs one call per width), it
mirrors ``GenerationMixin._beam_search`` line for line, per request rather than per batch (so a
request's beams never depend on the requests beside it):

1. log-softmax of each beam row's float32 logits, plus the beam's running score; top P over K x V,
   P = max(2, 1 + stop ids) x K so that K unfinished candidates always remain;
2. candidates that hit a stop id or the length limit cannot run on; the best K others become the new
   running beams (their tokens, scores, and the beam each continues: its *parent*);
3. finished candidates among the top K enter the request's K hypotheses, scored
   ``log_prob / generated_len ** length_penalty``, unless the hypotheses are full (early_stopping=True)
   or HF's heuristic says no running beam can improve on them;
4. the request is done when no improvement is possible, or (early_stopping=True) K hypotheses are in,
   or every candidate hit a stop.

The reorder never copies KV: each beam row's cache-indirection row says, per position, which beam row
of the request wrote that position's key (TensorRT-LLM's ``cacheIndirection``). A new beam takes its
parent's row up to the current position; positions after it are its own. Nothing here reads back to the
host; rows of a request the device already finished are left as they are (their output is DISCARDED).
"""

from __future__ import annotations

import torch

NEG = -1.0e9  # HF's "impossible" score: added, not assigned, so the arithmetic matches its float32 rounding


@torch.jit.script
def _inverse_penalty(lengths: torch.Tensor, length_penalty: torch.Tensor) -> torch.Tensor:
    """``1 / length ** length_penalty`` as HF's division gets it: HF divides a float32 tensor by a Python
    float (computed in float64), and PyTorch's CPU kernel divides by a scalar as a multiplication by its
    float32 reciprocal — so a plain division here would differ from HF in the last bit."""
    return 1.0 / (lengths.double() ** length_penalty.double()).float()


@torch.jit.script
def beam_step(logits: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, width: int, pool: int, glen: int,
              kv_width: int, max_beam: int, scores: torch.Tensor, seq: torch.Tensor, hyp_seq: torch.Tensor,
              hyp_score: torch.Tensor, hyp_len: torch.Tensor, hyp_done: torch.Tensor, improvable: torch.Tensor,
              indirection: torch.Tensor, gen_len: torch.Tensor, max_new: torch.Tensor, stop_ids: torch.Tensor,
              finished: torch.Tensor, length_penalty: torch.Tensor, early_stopping: torch.Tensor,
              prompt_len: torch.Tensor, last_token: torch.Tensor) -> None:
    """logits [R*K, V] float32, beams of a request adjacent; slots [R]; out [R, 2] (beam 0's token, finish
    code). ``glen`` > every request's generated count, ``kv_width`` > every request's next position:
    host-known bounds, so that only the live prefix of the per-slot buffers is touched."""
    r, k, vocab = slots.size(0), width, logits.size(1)
    dev = logits.device
    neg = -1.0e9  # NEG (TorchScript reads no module globals)
    active = ~finished[slots]  # [R] requests the device has not finished
    cur = gen_len[slots]  # [R] tokens generated before this step: the index of the one chosen now
    lp = length_penalty[slots]  # [R]
    es = early_stopping[slots]  # [R] 0 False, 1 True, 2 "never"
    running = scores[slots, :k]  # [R, K]
    acc = torch.log_softmax(logits, dim=-1).view(r, k, vocab) + running.unsqueeze(2)  # [R, K, V]
    top_lp, top_idx = torch.topk(acc.view(r, k * vocab), pool)  # [R, P]
    parent = torch.div(top_idx, vocab, rounding_mode="floor")  # [R, P] beam each candidate extends
    tok = top_idx % vocab  # [R, P]
    seqs = seq[slots, :k, :glen]  # [R, K, glen] running beams' generated tokens
    cand = torch.gather(seqs, 1, parent.unsqueeze(2).expand(r, pool, glen))  # [R, P, glen] (a new tensor)
    cand.scatter_(2, cur.view(r, 1, 1).expand(r, pool, 1), tok.unsqueeze(2))
    stops = stop_ids[slots]  # [R, M], -1 unused
    hits = (stops.unsqueeze(1) == tok.unsqueeze(2)).any(dim=2) | (cur + 1 >= max_new[slots]).unsqueeze(1)  # [R, P]

    # Running beams: the best K candidates that did not stop.
    run_lp = top_lp + hits.to(torch.float32) * neg  # [R, P]
    nxt = torch.topk(run_lp, k)[1]  # [R, K]
    new_seq = torch.gather(cand, 1, nxt.unsqueeze(2).expand(r, k, glen))  # [R, K, glen]
    new_scores = torch.gather(run_lp, 1, nxt)  # [R, K]
    new_parent = torch.gather(parent, 1, nxt)  # [R, K]
    new_tok = torch.gather(tok, 1, nxt)  # [R, K]

    # Hypotheses: finished candidates among the top K, merged with those kept so far; the best K stay.
    just_done = hits & (torch.arange(pool, device=dev) < k).unsqueeze(0)  # [R, P]
    done_lp = top_lp * _inverse_penalty(cur + 1, lp).unsqueeze(1)  # [R, P]
    full = hyp_done[slots, :k].all(dim=1, keepdim=True) & (es == 1).unsqueeze(1)  # [R, 1]
    done_lp = done_lp + full.to(torch.float32) * neg
    done_lp = done_lp + (~improvable[slots]).to(torch.float32).unsqueeze(1) * neg
    done_lp = done_lp + (~just_done).to(torch.float32) * neg
    m_score = torch.cat((hyp_score[slots, :k], done_lp), dim=1)  # [R, K + P]
    keep = torch.topk(m_score, k)[1]  # [R, K]
    old_hyp = hyp_seq[slots, :k, :glen]  # [R, K, glen]
    m_seq = torch.cat((old_hyp, cand), dim=1)  # [R, K + P, glen]
    new_hyp_seq = torch.gather(m_seq, 1, keep.unsqueeze(2).expand(r, k, glen))  # [R, K, glen]
    new_hyp_score = torch.gather(m_score, 1, keep)  # [R, K]
    new_hyp_len = torch.gather(torch.cat((hyp_len[slots, :k], (cur + 1).unsqueeze(1).expand(r, pool)), 1), 1, keep)
    new_hyp_done = torch.gather(torch.cat((hyp_done[slots, :k], just_done), 1), 1, keep)  # [R, K]

    # HF's heuristic: can the best running beam, at its best hypothetical length, beat the worst hypothesis?
    best_len = torch.where((es == 2) & (lp > 0), max_new[slots], cur + 1)  # [R]
    best = new_scores[:, :1] * _inverse_penalty(best_len, lp).unsqueeze(1)  # [R, 1]
    worst = torch.where(new_hyp_done, new_hyp_score.min(dim=1, keepdim=True)[0],
                        torch.full_like(new_hyp_score, neg))  # [R, K]
    new_improvable = improvable[slots] & (best > worst).any(dim=1)  # [R]
    beams_open = ~(new_hyp_done.all(dim=1) & (es == 1))  # [R]
    done = ~(new_improvable & beams_open & ~hits.all(dim=1))  # [R]

    # Write back, leaving requests the device had already finished untouched.
    a1, a3 = active.view(r, 1), active.view(r, 1, 1)
    scores[slots, :k] = torch.where(a1, new_scores, running)
    seq[slots, :k, :glen] = torch.where(a3, new_seq, seqs)
    hyp_seq[slots, :k, :glen] = torch.where(a3, new_hyp_seq, old_hyp)
    hyp_score[slots, :k] = torch.where(a1, new_hyp_score, hyp_score[slots, :k])
    hyp_len[slots, :k] = torch.where(a1, new_hyp_len, hyp_len[slots, :k])
    hyp_done[slots, :k] = torch.where(a1, new_hyp_done, hyp_done[slots, :k])
    improvable[slots] = torch.where(active, new_improvable, improvable[slots])
    last_token[slots, :k] = torch.where(a1, new_tok, last_token[slots, :k])
    gen_len[slots] = cur + active.long()
    finished[slots] = finished[slots] | (active & done)

    # Cache indirection: new beam b reads its parent's sources up to this step's position p, then its own.
    rows = (slots * max_beam).unsqueeze(1) + torch.arange(k, device=dev).unsqueeze(0)  # [R, K] indirection rows
    old = indirection[rows.flatten(), :kv_width].view(r, k, kv_width)  # [R, K, W]
    inherited = torch.gather(old, 1, new_parent.unsqueeze(2).expand(r, k, kv_width))  # [R, K, W]
    p = (prompt_len[slots] + cur - 1).view(r, 1, 1)  # position of this step's input token
    own = torch.arange(k, device=dev).view(1, k, 1).expand(r, k, kv_width)
    kpos = torch.arange(kv_width, device=dev).view(1, 1, kv_width)
    new_ind = torch.where(kpos <= p, inherited, own)  # [R, K, W]
    indirection[rows.flatten(), :kv_width] = torch.where(a3, new_ind, old).view(r * k, kv_width)

    length = (cur + 1 >= max_new[slots]).long()
    code = torch.where(done, 1 + length, torch.zeros_like(length))  # STOP 1 / LENGTH 2 / CONTINUE 0
    out[:, 0] = new_tok[:, 0]
    out[:, 1] = torch.where(active, code, torch.full_like(code, -1))
