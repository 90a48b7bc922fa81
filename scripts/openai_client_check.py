#!/usr/bin/env python3
"""Checks a Tessera coordinator with the official `openai` Python client.

Usage: scripts/openai_client_check.py BASE_URL MODEL
  BASE_URL  the API root, e.g. http://127.0.0.1:8000/v1
  MODEL     a served model with a tokenizer and a chat template
The API key comes from OPENAI_API_KEY (or TESSERA_API_KEY), else "none".

Runs completions and chat completions, streaming and not, and checks the shapes the client
parses (ids, finish_reason, usage), and that a greedy request (temperature 0, fixed seed)
streams exactly the text it returns without streaming. Exits non-zero on the first failure.
"""

import os
import sys

import openai

MAX_TOKENS = 12
SEED = 1234


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def check_usage(usage, what):
    check(usage is not None, f"{what}: no usage")
    check(usage.prompt_tokens > 0, f"{what}: prompt_tokens {usage.prompt_tokens}")
    check(
        0 < usage.completion_tokens <= MAX_TOKENS,
        f"{what}: completion_tokens {usage.completion_tokens}",
    )
    check(
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
        f"{what}: total_tokens {usage.total_tokens}",
    )


def completions(client, model):
    args = dict(model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS,
                temperature=0, seed=SEED)
    whole = client.completions.create(**args)
    check(whole.id.startswith("cmpl-"), f"completion id {whole.id}")
    check(whole.object == "text_completion", f"object {whole.object}")
    check(len(whole.choices) == 1, f"{len(whole.choices)} choices")
    choice = whole.choices[0]
    check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
    check_usage(whole.usage, "completion")

    text, finish, usage, ids = "", None, None, set()
    for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    check(len(ids) == 1 and next(iter(ids)).startswith("cmpl-"), f"stream ids {ids}")
    check(text == choice.text, f"streamed {text!r} != {choice.text!r}")
    check(finish == choice.finish_reason, f"streamed finish {finish}")
    check_usage(usage, "streamed completion")
    check(usage.completion_tokens == whole.usage.completion_tokens, "streamed usage differs")
    print(f"completions ok: {choice.text!r} ({choice.finish_reason})")


def chat(client, model):
    args = dict(model=model, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=MAX_TOKENS, temperature=0, seed=SEED)
    whole = client.chat.completions.create(**args)
    check(whole.id.startswith("chatcmpl-"), f"chat id {whole.id}")
    check(whole.object == "chat.completion", f"object {whole.object}")
    message = whole.choices[0].message
    check(message.role == "assistant", f"role {message.role}")
    check(isinstance(message.content, str), "content is not a string")
    finish = whole.choices[0].finish_reason
    check(finish in ("stop", "length"), f"finish_reason {finish}")
    check_usage(whole.usage, "chat")

    text, streamed_finish, usage, role = "", None, None, None
    for chunk in client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        check(chunk.id.startswith("chatcmpl-"), f"chunk id {chunk.id}")
        check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object}")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            role = c.delta.role or role
            text += c.delta.content or ""
            streamed_finish = c.finish_reason or streamed_finish
    check(role == "assistant", f"streamed role {role}")
    check(text == message.content, f"streamed {text!r} != {message.content!r}")
    check(streamed_finish == finish, f"streamed finish {streamed_finish}")
    check_usage(usage, "streamed chat")
    print(f"chat ok: {message.content!r} ({finish})")


def errors(client, model):
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, temperature=5)
    except openai.BadRequestError as error:
        check(error.status_code == 400, f"status {error.status_code}")
    else:
        raise AssertionError("temperature 5 was accepted")
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("an unknown model was accepted")
    print("errors ok")


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    base_url, model = sys.argv[1], sys.argv[2]
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("TESSERA_API_KEY") or "none"
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    completions(client, model)
    chat(client, model)
    errors(client, model)
    print("openai client check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
