"""POST /tokenize and /detokenize (vLLM's extensions)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import OpenAIServingError
from pagedllm.entrypoints.openai.protocol import messages_as_dicts
from pagedllm.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

LARGE_DECODE_TOKENS = 4096


class OpenAIServingTokenization(OpenAIServingChat):
    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            if not req.messages:
                raise OpenAIServingError("messages: must contain at least one message", 400, "messages")
            _, ids = await self.render_messages(
                messages_as_dicts(req.messages),
                req.chat_template,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                req.add_special_tokens,
                [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            )
        else:
            self.precheck_text_len(req.prompt)
            ids = await self.engine.encode_text(req.prompt, req.add_special_tokens)
        if len(ids) > self.max_model_len:
            # Bounded like every other route: the response (and the API process) never holds more than
            # a context's worth of tokens.
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the text has "
                f"{len(ids)} tokens. Please reduce the length of the input.",
                400,
                "messages" if isinstance(req, TokenizeChatRequest) else "prompt",
            )
        strs = self.engine.get_tokenizer().convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        tok = self.engine.get_tokenizer()
        limit = max(vocab, len(tok))
        bad = next((t for t in req.tokens if not 0 <= t < limit), None)
        if bad is not None:
            raise OpenAIServingError(f"tokens: token id {bad} is out of the vocabulary (size {limit})", 400, "tokens")
        if len(req.tokens) > LARGE_DECODE_TOKENS:
            text = await self.engine.run_in_worker(tok.decode, req.tokens)
        else:
            text = tok.decode(req.tokens)
        return DetokenizeResponse(prompt=text)
