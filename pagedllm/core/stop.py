"""When a request stops: after each appended token (as vLLM's `check_stop`). Stop strings are matched on
the detokenized text by the output processor, which aborts the request here."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int) -> bool:
    """Whether `token`, just appended to `req`, finishes it; if so sets its status (and stop reason)."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and token == sp.eos_token_id and token is not None:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if sp.stop_token_ids and token in sp.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token
            return True
    if n_out >= req.max_tokens or len(req.all_token_ids) >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def may_stop(req: Request, token: int, num_tokens: int) -> bool:
    """A cheap pre-test (NOTES H1): only a token in the request's stop set, or reaching `stop_len`
    (min(prompt + max_tokens, max_model_len)), can stop it; `check_stop` decides."""
    return num_tokens >= req.stop_len or token in req.stop_token_set


def append_until_stop(req: Request, tokens: list[int], max_model_len: int) -> tuple[list[int], bool]:
    """Appends `tokens` to `req` one by one until one stops it: (the tokens appended, stopped)."""
    if len(tokens) == 1:  # the common case: one sampled token, no per-token list building
        tok = tokens[0]
        n = req.append_output_token(tok)
        return tokens, may_stop(req, tok, n) and check_stop(req, tok, max_model_len)
    new_tokens: list[int] = []
    for tok in tokens:
        n = req.append_output_token(tok)
        new_tokens.append(tok)
        if may_stop(req, tok, n) and check_stop(req, tok, max_model_len):
            return new_tokens, True
    return new_tokens, False
