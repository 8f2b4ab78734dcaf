"""The API server process: OpenAI-compatible HTTP in front of the scheduler.

It validates requests, applies the chat template, tokenizes, sends ``TextContext``s to the
scheduler over ZeroMQ, and turns the token stream that comes back into text: incremental
detokenization, stop strings, usage, SSE chunks. It never imports torch.
"""
